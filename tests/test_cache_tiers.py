"""TieredCache across tiers: write policies, eviction down the tiers and reload, salts, commits."""

from __future__ import annotations

import uuid

import pytest

from cache_support import LAYOUT, P, assert_kv, make_cache, prompt, serve, store_keys, write_kv
from kvtier.errors import PoolExhausted
from kvtier.store.memory import MemoryStore
from kvtier.store.wrappers import CountingStore


def disk_store() -> MemoryStore:
    return MemoryStore(LAYOUT.page_bytes)


def test_write_through_reaches_the_store() -> None:
    disk = disk_store()
    with make_cache(stores={"disk": disk}) as cache:
        tokens = prompt(6, seed=1, extra=3)
        serve(cache, tokens)
        assert cache.drain()
        assert disk.contains(store_keys(tokens)) == [True] * 6
        stats = cache.stats()
        assert stats["tiers"]["host"]["pages"] == 6
        assert stats["tiers"]["disk"]["pages"] == 6
        assert stats["counters"]["backup_pages_total"]["disk"] == 6
        cache.check_integrity()


def test_device_to_host_to_store_and_back_gives_identical_bytes() -> None:
    disk = disk_store()
    with make_cache(device_pages=8, host_pages=16, stores={"disk": disk}) as cache:
        first = prompt(6, seed=2)
        serve(cache, first)
        cache.drain()
        for seed in range(3, 8):  # push the first prompt out of device and host
            serve(cache, prompt(6, seed=seed))
            cache.drain()
        hit = cache.match(first)
        assert hit.tokens_by_tier["disk"] > 0 and hit.tokens == 6 * P
        loaded = cache.load(hit)
        assert loaded.tokens == 6 * P
        assert_kv(cache, first, loaded.device_page_ids)
        cache.release(loaded)
        cache.check_integrity()


def test_flush_drops_device_and_host_but_stores_keep_everything() -> None:
    disk = disk_store()
    with make_cache(stores={"disk": disk}) as cache:
        tokens = prompt(5, seed=3)
        serve(cache, tokens)
        dropped = cache.flush()
        assert dropped == {"device": 5, "host": 5}
        hit = cache.match(tokens)
        assert hit.tokens_by_tier == {"device": 0, "host": 0, "disk": 5 * P, "remote": 0}
        _, loaded = serve(cache, tokens)
        assert loaded.tokens == 5 * P
        cache.check_integrity()


def test_pinned_pages_survive_flush_and_eviction() -> None:
    with make_cache(device_pages=8, host_pages=0) as cache:
        tokens = prompt(4, seed=4)
        serve(cache, tokens)
        loaded = cache.load(cache.match(tokens))
        cache.flush()
        assert cache.stats()["tiers"]["device"]["pages"] == 4
        with pytest.raises(PoolExhausted):
            cache.allocate(5)
        assert len(cache.allocate(4)) == 4
        assert_kv(cache, tokens, loaded.device_page_ids)
        cache.release(loaded)
        cache.release(loaded)  # idempotent
        assert cache.stats()["tiers"]["device"]["evictable"] == 4


def test_salts_isolate_tenants_on_every_tier() -> None:
    disk = disk_store()
    with make_cache(stores={"disk": disk}) as cache:
        tokens = prompt(4, seed=5)
        serve(cache, tokens, salt="tenant-a")
        cache.drain()
        assert cache.match(tokens, "tenant-b").tokens == 0
        assert cache.match(tokens).tokens == 0
        assert cache.match(tokens, "tenant-a").tokens_by_tier["device"] == 4 * P
        assert disk.contains(store_keys(tokens, "tenant-b")) == [False] * 4
        cache.flush()
        assert cache.match(tokens, "tenant-b").tokens == 0
        assert cache.match(tokens, "tenant-a").tokens_by_tier["disk"] == 4 * P


def test_requests_sharing_a_prefix_share_pages_and_free_duplicates() -> None:
    with make_cache(device_pages=32) as cache:
        base = prompt(4, seed=6)
        a, b = base + prompt(2, seed=7), base + prompt(3, seed=8)
        hit_a, hit_b = cache.match(a), cache.match(b)  # both miss, both compute the prefix
        loaded_a, loaded_b = cache.load(hit_a), cache.load(hit_b)
        ids_a, ids_b = cache.allocate(6), cache.allocate(7)
        write_kv(cache, a, ids_a)
        write_kv(cache, b, ids_b)
        cache.commit(a, ids_a)
        cache.commit(b, ids_b)  # pages 0-3 are already held: b's copies are freed
        cache.release(loaded_a)
        cache.release(loaded_b)
        assert cache.stats()["tiers"]["device"]["pages"] == 6 + 3
        hit = cache.match(b)
        assert hit.device_page_ids[:4] == ids_a[:4]
        assert_kv(cache, b, hit.device_page_ids)
        cache.check_integrity()


def test_concurrent_loads_of_one_prefix_pin_it_for_both() -> None:
    disk = disk_store()
    with make_cache(stores={"disk": disk}) as cache:
        tokens = prompt(6, seed=9)
        serve(cache, tokens)
        cache.flush()
        first = cache.load(cache.match(tokens))
        second = cache.load(cache.match(tokens))
        assert first.device_page_ids == second.device_page_ids
        assert cache.stats()["tiers"]["device"]["protected"] == 6
        cache.release(first)
        assert cache.stats()["tiers"]["device"]["protected"] == 6
        cache.release(second)
        assert cache.stats()["tiers"]["device"]["protected"] == 0
        cache.check_integrity()


def test_commit_refuses_page_ids_it_did_not_hand_out() -> None:
    with make_cache() as cache:
        tokens = prompt(2, seed=10)
        with pytest.raises(ValueError, match="not handed out"):
            cache.commit(tokens, [0, 1])
        ids = cache.allocate(2)
        with pytest.raises(ValueError, match="twice"):
            cache.commit(tokens, [ids[0], ids[0]])
        cache.free(ids)
        cache.check_integrity()


def test_partial_last_page_is_never_committed() -> None:
    with make_cache() as cache:
        tokens = prompt(3, seed=11, extra=2)
        ids = cache.allocate(4)
        write_kv(cache, tokens[:12], ids[:3])
        cache.commit(tokens, ids)  # the fourth id (partial page) goes back to the pool
        assert cache.stats()["tiers"]["device"]["pages"] == 3
        assert cache.stats()["tiers"]["device"]["free"] == 32 - 3
        cache.check_integrity()


def test_write_back_copies_to_host_only_when_the_device_evicts() -> None:
    with make_cache(device_pages=8, host_pages=16, write_policy="write_back") as cache:
        first = prompt(6, seed=12)
        serve(cache, first)
        assert cache.stats()["tiers"]["host"]["pages"] == 0
        serve(cache, prompt(6, seed=13))  # evicts the first prompt's pages: written back
        hit = cache.match(first)
        assert hit.tokens == 6 * P and hit.tokens_by_tier["host"] > 0
        _, loaded = serve(cache, first)
        assert loaded.tokens == 6 * P
        cache.check_integrity()


def test_write_through_selective_copies_on_the_second_hit() -> None:
    with make_cache(write_policy="write_through_selective") as cache:
        tokens = prompt(4, seed=14)
        serve(cache, tokens)
        assert cache.stats()["tiers"]["host"]["pages"] == 0
        serve(cache, tokens)
        assert cache.stats()["tiers"]["host"]["pages"] == 4
        cache.check_integrity()


def test_write_through_selective_copies_a_continuation_whole() -> None:
    """The next turn of a conversation reads its earlier turn again: that turn and the new
    pages after it are what the turn after will read, so all of it is copied down (the load
    and the commit of one request count its pages as seen once, not twice)."""
    with make_cache(write_policy="write_through_selective") as cache:
        first = prompt(4, seed=17)
        serve(cache, first)
        assert cache.stats()["tiers"]["host"]["pages"] == 0
        serve(cache, first + prompt(2, seed=18))
        cache.drain()
        assert cache.stats()["tiers"]["host"]["pages"] == 6
        cache.check_integrity()


def test_recomputed_head_loads_only_the_tail_into_private_pages() -> None:
    disk = disk_store()
    with make_cache(stores={"disk": disk}) as cache:
        tokens = prompt(8, seed=15)
        serve(cache, tokens)
        cache.flush()
        hit = cache.match(tokens)
        loaded = cache.load(hit, recompute_tokens=3 * P)
        assert (loaded.start_tokens, loaded.tokens) == (3 * P, 8 * P)
        assert_kv(cache, tokens, loaded.device_page_ids, 3)
        assert cache.stats()["tiers"]["device"]["pages"] == 0  # not indexed until committed
        cache.check_integrity()
        fresh = cache.allocate(3)
        write_kv(cache, tokens, fresh)
        cache.commit(tokens, fresh + loaded.device_page_ids)
        cache.release(loaded)
        assert cache.match(tokens).tokens_by_tier["device"] == 8 * P
        cache.check_integrity()


def test_release_without_commit_frees_private_pages() -> None:
    disk = disk_store()
    with make_cache(stores={"disk": disk}) as cache:
        tokens = prompt(6, seed=16)
        serve(cache, tokens)
        cache.flush()
        loaded = cache.load(cache.match(tokens), recompute_tokens=2 * P)
        assert loaded.pages == 4
        cache.release(loaded)
        assert cache.stats()["tiers"]["device"]["free"] == 32
        cache.check_integrity()


def test_host_tier_off_keeps_a_device_only_cache() -> None:
    with make_cache(host_pages=0) as cache:
        tokens = prompt(3, seed=17)
        serve(cache, tokens)
        assert cache.match(tokens).tokens_by_tier["device"] == 3 * P
        assert "host" not in {t for t, v in cache.stats()["tiers"].items() if v["pages"]}
        cache.check_integrity()


def test_shared_store_serves_a_second_cache_instance() -> None:
    name = "shared-test-store"
    first = MemoryStore(LAYOUT.page_bytes, name=name)
    tokens = prompt(5, seed=18)
    with make_cache(stores={"disk": first}) as cache:
        serve(cache, tokens)
        cache.drain()
    second = CountingStore(MemoryStore(LAYOUT.page_bytes, name=name))
    with make_cache(stores={"disk": second}) as other:
        hit = other.match(tokens)
        assert hit.tokens_by_tier["disk"] == 5 * P  # found by probing, not by the index
        _, loaded = serve(other, tokens)
        assert loaded.tokens == 5 * P
        other.drain()
        assert second.counts()["write"].pages == 0  # backup saw the pages were there already
    first.clear()


def test_plan_split_recomputes_a_head_only_when_it_pays() -> None:
    name = f"split-{uuid.uuid4().hex}"
    tokens = prompt(8, seed=19)
    with make_cache(stores={"disk": MemoryStore(LAYOUT.page_bytes, name=name)}) as writer:
        serve(writer, tokens)
        writer.drain()
    with make_cache(stores={"disk": MemoryStore(LAYOUT.page_bytes, name=name)}) as cache:
        hit = cache.match(tokens)
        assert cache.plan_split(hit) == 0  # no prefill rate known yet: load everything
        cache.observe_prefill(10_000, 1.0)
        cache.controller.rates.rates["disk"] = (1e6, 0.0)  # 7.8k tokens/s of this layout
        split = cache.plan_split(hit)
        assert 0 < split < 8 * P and split % P == 0
        cache.controller.rates.rates["disk"] = (1e12, 0.0)
        assert cache.plan_split(hit) == 0  # loading is far faster: recompute nothing
        cache.controller.rates.rates["disk"] = (1.0, 0.0)
        assert cache.plan_split(hit) == 8 * P  # loading is hopeless: recompute all
        serve(cache, tokens)
        assert cache.plan_split(cache.match(tokens)) == 0  # a device hit is never recomputed


@pytest.mark.parametrize(("flag", "name"), [(None, "shadow"), ("lru", "lru"), ("lrfu", "lrfu")])
def test_the_configured_eviction_policy_runs_the_device_and_host_tiers(flag, name) -> None:
    from cache_support import NAMESPACE
    from kvtier.cache import TieredCache
    from kvtier.config import build_config

    flags = {"cache.page_size": P, "cache.device_pages": 8,
             "host.pool_bytes": 16 * LAYOUT.page_bytes}
    if flag is not None:
        flags["cache.eviction_policy"] = flag
    cache = TieredCache.build(build_config(env={}, flags=flags), LAYOUT, NAMESPACE)
    try:
        from kvtier.index.residency import TIER_INDEX

        for tier in ("device", "host"):
            assert cache.ctx.index.ledgers[TIER_INDEX[tier]].policy.name == name
        for seed in range(6):  # more than the device holds: the policy picks what goes
            serve(cache, prompt(3, seed))
        cache.check_integrity()
    finally:
        cache.close()


def test_the_copy_warm_up_runs_each_copy_once_on_free_pages_and_gives_them_back(caplog) -> None:
    from kvtier.controller.wiring import warm_up_copies

    with make_cache() as cache:
        tokens = prompt(3, seed=4)
        serve(cache, tokens)
        ctx = cache.ctx
        assert ctx.copy is not None and ctx.host_pool is not None
        free = {t: ctx.index.sizes(t) for t in ("device", "host")}
        before = ctx.copy.stats()
        warm_up_copies(ctx)
        after = ctx.copy.stats()
        assert (after["store_batches"], after["load_batches"]) == (
            before["store_batches"] + 1, before["load_batches"] + 2)
        assert {t: ctx.index.sizes(t) for t in ("device", "host")} == free
        assert_kv(cache, tokens, cache.device_prefix(tokens))   # nothing held was touched
        cache.check_integrity()

        def broken(device_id: int, host_id: int) -> None:
            raise RuntimeError("no kernels")
        ctx.copy.warm_up = broken                    # type: ignore[method-assign]
        warm_up_copies(ctx)                          # logged; start-up goes on
        assert "warm-up failed" in caplog.text
        assert {t: ctx.index.sizes(t) for t in ("device", "host")} == free


def test_allocate_reaps_finished_host_copies_before_it_gives_up(monkeypatch) -> None:
    """Every device page is locked by a host copy that has landed but that no poll has reaped
    yet: ``allocate`` reaps finished copies and hands the pages out instead of failing."""
    from kvtier.transfer.copy_engine import Ticket

    landed = {"yes": False}
    monkeypatch.setattr(Ticket, "is_done", lambda self: landed["yes"])
    cache = make_cache(device_pages=8, host_pages=64)
    tokens = prompt(8, 1)
    ids = cache.allocate(8)
    write_kv(cache, tokens, ids)
    cache.commit(tokens, ids)                  # its host copy is in flight: the pages are locked
    with pytest.raises(PoolExhausted):
        cache.allocate(1)
    landed["yes"] = True                       # the copy lands; nothing has polled since
    fresh = cache.allocate(8)
    assert len(fresh) == 8
    assert cache.match(tokens).tokens_by_tier.get("host", 0) == 8 * P
    cache.free(fresh)
    cache.check_integrity()
    cache.close()
