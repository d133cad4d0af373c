"""Runtime storage changes on a live TieredCache: attach, detach, clear, host pool rebuilds."""

from __future__ import annotations

import threading
import uuid

import pytest

from cache_support import LAYOUT, P, make_cache, prompt, serve, store_keys
from kvtier.admin.bindings import SwapFailed
from kvtier.admin.host_rebuild import rebuild_host_pool
from kvtier.admin.reconfig import Busy, NotAttached, StorageAdmin, Unsupported
from kvtier.admin.reconfig_support import redact_store_url
from kvtier.config import build_config
from kvtier.errors import LayoutMismatch
from kvtier.index.radix import as_token_bytes
from kvtier.layout import KVLayout
from kvtier.memory import HostPool, PinnedBudget
from kvtier.store.memory import MemoryStore

CONFIG = build_config(env={}, flags={"cache.page_size": P, "controller.io_workers": 2,
                                     "controller.min_prefetch_tokens": 0})


class GatedStore(MemoryStore):
    """A memory store whose writes wait at a gate: a write stays 'in flight' until opened."""

    def __init__(self, name: str) -> None:
        super().__init__(LAYOUT.page_bytes, name=name)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def write(self, keys, buffers):  # type: ignore[no-untyped-def]
        self.entered.set()
        self.gate.wait(10)
        return super().write(keys, buffers)


def page_bytes_of(tokens: list[int], page: int) -> bytes:
    from cache_support import pattern

    return pattern(tokens[page * P:(page + 1) * P]).numpy().tobytes()


def test_attach_then_detach_moves_every_reader_and_keeps_serving() -> None:
    with make_cache() as cache:
        admin = StorageAdmin(cache, CONFIG)
        name = f"memory://attach-{uuid.uuid4().hex}"
        assert admin.attach("disk", name)["generation"] == 2
        tokens = prompt(6, seed=1)
        serve(cache, tokens)
        assert cache.drain()
        assert cache.stats()["tiers"]["disk"]["pages"] == 6
        assert admin.storage()[0]["pages"] == 6
        cache.flush()
        _, loaded = serve(cache, tokens)  # bytes come back from the attached store
        assert loaded.tokens == 6 * P
        result = admin.detach("disk")
        assert result["generation"] == 3 and "disk" not in cache.ctx.stores
        assert cache.stats()["tiers"]["disk"]["pages"] == 0
        admin.table.assert_coherent()
        serve(cache, prompt(5, seed=2))
        cache.check_integrity()


def test_detach_waits_for_the_write_in_flight_and_cancels_the_rest_whole() -> None:
    name = f"gated-{uuid.uuid4().hex}"
    store = GatedStore(name)
    with make_cache(stores={"disk": store}) as cache:
        admin = StorageAdmin(cache, CONFIG)
        tokens = prompt(20, seed=3)  # one backup job of two batches: 16 pages, then 4
        serve(cache, tokens)
        assert store.entered.wait(5)
        done: dict[str, object] = {}
        worker = threading.Thread(target=lambda: done.update(admin.detach("disk")))
        worker.start()
        worker.join(0.3)
        assert worker.is_alive(), "detach returned while a write was still in flight"
        store.gate.set()
        worker.join(10)
        assert done["cancelled_jobs"] == 1
        reader = MemoryStore(LAYOUT.page_bytes, name=name)  # the same pages, another handle
        keys = store_keys(tokens)
        assert reader.contains(keys) == [True] * 16 + [False] * 4
        for page in range(16):
            buffer = bytearray(LAYOUT.page_bytes)
            assert reader.read_into([keys[page]], [buffer]) == [True]
            assert bytes(buffer) == page_bytes_of(tokens, page)
        assert cache.stats()["tiers"]["disk"]["pages"] == 0
        admin.table.assert_coherent()
        cache.check_integrity()


def test_detach_of_a_hanging_store_is_refused_and_leaves_it_attached() -> None:
    store = GatedStore(f"hang-{uuid.uuid4().hex}")
    with make_cache(stores={"disk": store}) as cache:
        admin = StorageAdmin(cache, CONFIG)
        serve(cache, prompt(4, seed=4))
        assert store.entered.wait(5)
        with pytest.raises(Busy, match="did not stop"):
            admin.detach("disk", wait_s=0.2)
        assert cache.ctx.stores["disk"] is store
        admin.table.assert_coherent()
        store.gate.set()
        assert admin.detach("disk")["detached"]


def test_clear_empties_the_store_and_the_index_marks_but_stays_attached() -> None:
    store = MemoryStore(LAYOUT.page_bytes)
    with make_cache(stores={"disk": store}) as cache:
        admin = StorageAdmin(cache, CONFIG)
        tokens = prompt(6, seed=5)
        serve(cache, tokens)
        assert cache.drain()
        result = admin.clear("disk")
        assert (result["pages_before"], result["pages_after"]) == (6, 0)
        assert cache.stats()["tiers"]["disk"]["pages"] == 0
        assert cache.ctx.stores["disk"] is store
        cache.flush()
        serve(cache, prompt(6, seed=6))
        assert cache.drain() and store.stats().pages == 6  # still writing through
        admin.table.assert_coherent()


def test_attach_failing_part_way_disables_the_tier_and_closes_the_new_store(monkeypatch) -> None:
    with make_cache() as cache:  # no store yet: attaching must start the IO workers
        admin = StorageAdmin(cache, CONFIG)

        def broken(*_args, **_kwargs):
            raise OSError("cannot start threads")

        monkeypatch.setattr("kvtier.controller.workers.IOWorkers", broken)
        name = f"memory://broken-{uuid.uuid4().hex}"
        with pytest.raises(SwapFailed, match="cannot start threads"):
            admin.attach("disk", name)
        slot = admin.table.stats()["slots"]["store.disk"]
        assert slot["failures"] == 1 and slot["disabled"].startswith("OSError")
        assert "disk" not in cache.ctx.stores
        admin.table.assert_coherent()
        serve(cache, prompt(4, seed=10))  # the cache goes on without the tier
        monkeypatch.undo()
        assert admin.attach("disk", name)["generation"] == 3  # and the tier can come back


def test_refusals_name_the_reason() -> None:
    with make_cache(stores={"disk": MemoryStore(LAYOUT.page_bytes)}) as cache:
        admin = StorageAdmin(cache, CONFIG)
        with pytest.raises(Busy, match="detach it first"):
            admin.attach("disk", "memory://other")
        with pytest.raises(NotAttached):
            admin.detach("remote")
        with pytest.raises(Unsupported, match="takes redis, rediss, memory"):
            admin.attach("remote", "file:///tmp/x")
        with pytest.raises(Unsupported, match="maxmemory"):
            admin.attach("remote", "redis://127.0.0.1:1/0", max_bytes=1 << 20)
    with make_cache(host_pages=0) as cache, pytest.raises(Busy, match="host tier is off"):
        StorageAdmin(cache, CONFIG).attach("disk", "memory://x")


def test_host_pool_rebuild_moves_every_reader_and_pages_still_round_trip() -> None:
    store = MemoryStore(LAYOUT.page_bytes)
    with make_cache(host_pages=64, stores={"disk": store}) as cache:
        admin = StorageAdmin(cache, CONFIG)
        old = cache.ctx.host_pool
        result = rebuild_host_pool(admin, pool_bytes=24 * LAYOUT.page_bytes)
        assert (result["old_pages"], result["new_pages"], result["generation"]) == (64, 24, 2)
        assert old.closed and cache.ctx.host_pool.num_pages == 24
        admin.table.assert_coherent()
        tokens = prompt(6, seed=7)
        serve(cache, tokens)
        assert cache.drain() and store.stats().pages == 6
        cache.flush()
        _, loaded = serve(cache, tokens)  # disk -> new host pool -> device, bytes checked
        assert loaded.tokens == 6 * P
        cache.check_integrity()


def test_host_pool_of_another_layout_is_refused_and_nothing_changes() -> None:
    with make_cache() as cache:
        admin = StorageAdmin(cache, CONFIG)
        old = cache.ctx.host_pool
        other = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype="float32", page_size=P)
        with pytest.raises(LayoutMismatch, match="num_layers 3 != 2"):
            rebuild_host_pool(admin, new_pool=HostPool(other, 8, PinnedBudget(1 << 20)))
        assert cache.ctx.host_pool is old and admin.table.current("host_pool").generation == 1
        admin.table.assert_coherent()


def test_rebuild_failing_part_way_disables_the_host_tier_and_counts_it(monkeypatch) -> None:
    store = MemoryStore(LAYOUT.page_bytes)
    with make_cache(stores={"disk": store}) as cache:
        admin = StorageAdmin(cache, CONFIG)

        def broken(*_args, **_kwargs):
            raise RuntimeError("no copy engine today")

        monkeypatch.setattr("kvtier.transfer.CopyEngine", broken)
        with pytest.raises(SwapFailed, match="no copy engine today"):
            rebuild_host_pool(admin, pool_bytes=16 * LAYOUT.page_bytes)
        stats = admin.table.stats()["slots"]
        assert stats["host_pool"]["failures"] == 1 and stats["host_pool"]["disabled"]
        assert stats["store.disk"]["disabled"] == "the host tier was disabled"
        assert cache.ctx.host_pool is None and cache.ctx.stores == {}
        admin.table.assert_coherent()
        tokens = prompt(4, seed=8)
        serve(cache, tokens)  # the device tier alone still serves
        _, loaded = serve(cache, tokens)
        assert loaded.tokens == 4 * P


def test_rebuild_refuses_while_host_pages_are_locked_and_changes_nothing() -> None:
    with make_cache() as cache:
        admin = StorageAdmin(cache, CONFIG)
        tokens = prompt(4, seed=9)
        serve(cache, tokens)
        node = cache.ctx.lock(as_token_bytes(tokens), b"", 4, "host")  # as a backup job does
        with pytest.raises(Busy, match="4 pages locked"):
            rebuild_host_pool(admin, pool_bytes=16 * LAYOUT.page_bytes)
        assert admin.table.current("host_pool").generation == 1
        cache.ctx.unlock(node, "host")
        assert rebuild_host_pool(admin, pool_bytes=16 * LAYOUT.page_bytes)["generation"] == 2


def test_shown_store_urls_hide_passwords_in_the_authority_and_the_query() -> None:
    shown = redact_store_url("rediss://user:pw1@h:6380/0?ssl_password=pw2&timeout_s=0.5")
    assert "pw1" not in shown and "pw2" not in shown
    assert shown.startswith("rediss://user:***@h:6380/0?") and "timeout_s=0.5" in shown
    assert redact_store_url("file:///var/cache/kvtier") == "file:///var/cache/kvtier"
