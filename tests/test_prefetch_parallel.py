"""A long prefetch is read by every IO worker at once, and still lands as a prefix."""

from __future__ import annotations

from pathlib import Path

from cache_support import LAYOUT, P, assert_kv, make_cache, prompt, serve, store_keys
from kvtier.store.file.store import FileStore
from kvtier.store.wrappers import CountingStore, FaultRule, FaultStore, LatencyStore


def written(root: Path, tokens: list[int]) -> None:
    with make_cache(device_pages=64, host_pages=128,
                    stores={"disk": FileStore(root, LAYOUT.page_bytes)}) as writer:
        serve(writer, tokens)
        assert writer.drain(10.0)


def test_one_prefetch_is_read_by_all_io_workers(tmp_path: Path) -> None:
    tokens = prompt(64, seed=1)                     # 16-page batches: 4 of them
    written(tmp_path, tokens)
    counting = CountingStore(LatencyStore(FileStore(tmp_path, LAYOUT.page_bytes), read_s=0.1))
    with make_cache(device_pages=80, host_pages=160, stores={"disk": counting}, io_workers=4,
                    prefetch_policy="wait_complete") as cache:
        loaded = cache.load(cache.match(tokens))
        assert loaded.tokens == 64 * P
        assert_kv(cache, tokens, loaded.device_page_ids)
        cache.release(loaded)
        assert counting.counts()["read"].peak_in_flight == 4
        assert cache.stats()["counters"]["prefetch_total"] == {"completed": 1}
        cache.check_integrity()


def test_a_miss_ends_the_parallel_prefetch_at_that_page(tmp_path: Path) -> None:
    tokens = prompt(64, seed=2)
    written(tmp_path, tokens)
    bad = store_keys(tokens)[37]
    faulty = FaultStore(LatencyStore(FileStore(tmp_path, LAYOUT.page_bytes), read_s=0.05),
                        [FaultRule("read", "error", keys=frozenset({bad}))])
    with make_cache(device_pages=80, host_pages=160, stores={"disk": faulty}, io_workers=4,
                    prefetch_policy="wait_complete") as cache:
        loaded = cache.load(cache.match(tokens))
        assert loaded.tokens == 37 * P
        assert_kv(cache, tokens, loaded.device_page_ids)
        cache.release(loaded)
        assert cache.drain(5.0)
        assert cache.stats()["counters"]["prefetch_total"] == {"failed": 1}
        assert cache.stats()["outside_index"] == {"device": 0, "host": 0}
        cache.check_integrity()
