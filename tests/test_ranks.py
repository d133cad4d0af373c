"""Several ranks serving one model: the hit used is the minimum across ranks, every rank makes
the same collective calls whatever its local state, and nothing deadlocks."""

from __future__ import annotations

import multiprocessing
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cache_support import LAYOUT, P, assert_kv, make_cache, prompt, serve
from kvtier.cache import TieredCache
from kvtier.controller.ranks import (
    LOAD_CALLS,
    MATCH_CALLS,
    SPLIT_CALLS,
    RankDisagreement,
    ThreadCollective,
)
from kvtier.controller.split import plan_split
from kvtier.store.memory import MemoryStore
from kvtier.store.wrappers import FaultRule, FaultStore, LatencyStore

TOKENS = prompt(8, seed=42)


def run_ranks(caches: list[TieredCache], step: Callable[[TieredCache], Any],
              timeout: float = 20.0) -> list[Any]:
    """Run ``step`` on every rank's cache in its own thread; re-raise the first failure."""
    results: list[Any] = [None] * len(caches)
    errors: list[BaseException] = []

    def main(rank: int) -> None:
        try:
            results[rank] = step(caches[rank])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=main, args=(r,)) for r in range(len(caches))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), "a rank hung"
    if errors:
        raise errors[0]
    return results


def match_and_load(cache: TieredCache) -> tuple[Any, Any, int]:
    calls = cache.controller.ranks.calls
    hit = cache.match(TOKENS)
    loaded = cache.load(hit)
    assert_kv(cache, TOKENS, loaded.device_page_ids)
    cache.release(loaded)
    return hit, loaded, cache.controller.ranks.calls - calls


def two_caches(stores: list[dict[str, Any]] | None = None, **controller: Any) -> list[TieredCache]:
    collective = ThreadCollective(2, timeout_s=10)
    return [make_cache(collective=collective.for_rank(r),
                       stores=(stores or [{}, {}])[r], **controller) for r in range(2)]


def test_ranks_with_different_device_hits_agree_on_the_minimum() -> None:
    caches = two_caches()
    serve_local(caches[0], TOKENS)
    serve_local(caches[1], TOKENS[:5 * P])
    results = run_ranks(caches, match_and_load)
    for hit, loaded, calls in results:
        assert hit.tokens == 5 * P and hit.tokens_by_tier["device"] == 5 * P
        assert loaded.tokens == 5 * P
        assert calls == MATCH_CALLS + LOAD_CALLS
    for cache in caches:
        cache.check_integrity()
        cache.close()


def test_ranks_with_hits_on_different_tiers_agree_after_a_prefetch_timeout() -> None:
    name = f"ranks-{uuid.uuid4().hex}"
    slow = LatencyStore(MemoryStore(LAYOUT.page_bytes, name=name), per_page_s=0.05)
    caches = two_caches([{}, {"disk": slow}], prefetch_timeout_base_s=0.2,
                        prefetch_timeout_per_1k_tokens_s=0.0)
    serve_local(caches[0], TOKENS)
    with make_cache(stores={"disk": MemoryStore(LAYOUT.page_bytes, name=name)}) as writer:
        serve(writer, TOKENS)
        writer.drain()
    results = run_ranks(caches, match_and_load)
    (hit0, loaded0, _), (hit1, loaded1, _) = results
    assert hit0.tokens_by_tier == hit1.tokens_by_tier == {"device": 0, "host": 0,
                                                          "disk": 8 * P, "remote": 0}
    assert loaded0.tokens == loaded1.tokens < 8 * P  # rank 1's landed prefix bounds both
    for cache in caches:
        cache.drain()
        cache.check_integrity()
        cache.close()


def test_a_rank_whose_store_fails_still_makes_every_call() -> None:
    name = f"ranks-{uuid.uuid4().hex}"
    with make_cache(stores={"disk": MemoryStore(LAYOUT.page_bytes, name=name)}) as writer:
        serve(writer, TOKENS)
        writer.drain()
    broken = FaultStore(MemoryStore(LAYOUT.page_bytes, name=name), [FaultRule("read", "raise")])
    good = MemoryStore(LAYOUT.page_bytes, name=name)
    caches = two_caches([{"disk": good}, {"disk": broken}], prefetch_policy="wait_complete")
    results = run_ranks(caches, match_and_load)
    assert [loaded.tokens for _, loaded, _ in results] == [0, 0]
    assert [calls for _, _, calls in results] == [MATCH_CALLS + LOAD_CALLS] * 2
    for cache in caches:
        cache.drain()
        cache.check_integrity()
        cache.close()


def test_a_rank_whose_load_raises_locally_still_makes_every_call() -> None:
    caches = two_caches()
    for cache in caches:
        serve_local(cache, TOKENS)

    def broken_prepare(*args: Any) -> None:
        raise RuntimeError("local bug while preparing the load")

    caches[1].controller.loader._prepare = broken_prepare  # type: ignore[method-assign]
    results = run_ranks(caches, match_and_load)
    assert [loaded.tokens for _, loaded, _ in results] == [0, 0]
    assert [calls for _, _, calls in results] == [MATCH_CALLS + LOAD_CALLS] * 2
    assert caches[1].stats()["counters"]["load_errors_total"] == 1
    for cache in caches:
        cache.check_integrity()
        cache.close()


def test_an_empty_cache_rank_and_a_full_one_make_the_same_calls() -> None:
    caches = two_caches()
    serve_local(caches[0], TOKENS)

    def three_requests(cache: TieredCache) -> int:
        before = cache.controller.ranks.calls
        for _ in range(3):
            serve(cache, TOKENS, check=False)
        return cache.controller.ranks.calls - before

    assert run_ranks(caches, three_requests) == [3 * (MATCH_CALLS + LOAD_CALLS)] * 2
    for cache in caches:
        cache.close()


def test_ranks_agree_on_the_split_although_their_rates_differ() -> None:
    name = f"ranks-{uuid.uuid4().hex}"
    with make_cache(stores={"disk": MemoryStore(LAYOUT.page_bytes, name=name)}) as writer:
        serve(writer, TOKENS)
        writer.drain()
    caches = two_caches([{"disk": MemoryStore(LAYOUT.page_bytes, name=name)} for _ in range(2)])
    for cache, disk_rate in zip(caches, (1e6, 3e5), strict=True):
        cache.observe_prefill(10_000, 1.0)
        cache.controller.rates.rates["disk"] = (disk_rate, 0.0)

    def split(cache: TieredCache) -> tuple[Any, int, int]:
        before = cache.controller.ranks.calls
        hit = cache.match(TOKENS)
        return hit, cache.plan_split(hit), cache.controller.ranks.calls - before

    results = run_ranks(caches, split)
    local = [plan_split(hit, cache.controller.rates, LAYOUT.bytes_per_token)
             for cache, (hit, _, _) in zip(caches, results, strict=True)]
    assert local[0] != local[1]
    assert [agreed for _, agreed, _ in results] == [min(local)] * 2
    assert [calls for _, _, calls in results] == [MATCH_CALLS + SPLIT_CALLS] * 2
    for cache in caches:
        cache.close()


def test_a_rank_that_skips_a_call_raises_instead_of_hanging() -> None:
    collective = ThreadCollective(2, timeout_s=0.3)
    cache = make_cache(collective=collective.for_rank(0))
    with pytest.raises(RankDisagreement):
        cache.match(TOKENS)  # rank 1 never calls
    cache.close()


def serve_local(cache: TieredCache, tokens: list[int]) -> None:
    """Fill one rank's cache outside the collective (as if from its own earlier traffic)."""
    ids = cache.allocate(len(tokens) // P)
    from cache_support import write_kv

    write_kv(cache, tokens, ids)
    cache.commit(tokens, ids)


# ---- two processes over torch.distributed (gloo) ---------------------------------------------
def _gloo_rank(rank: int, init_file: str, pages: int, out: Any) -> None:
    import torch.distributed as dist

    from kvtier.controller.ranks import torch_min_across_ranks

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        cache = make_cache(collective=torch_min_across_ranks())
        serve_local(cache, TOKENS[:pages * P])
        hit = cache.match(TOKENS)
        loaded = cache.load(hit)
        out.put((rank, hit.tokens, loaded.tokens, cache.controller.ranks.calls))
        cache.release(loaded)
        cache.close()
    finally:
        dist.destroy_process_group()


def test_two_processes_agree_through_torch_distributed(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    init = str(tmp_path / "gloo-init")
    procs = [ctx.Process(target=_gloo_rank, args=(r, init, pages, out))
             for r, pages in ((0, 8), (1, 3))]
    for proc in procs:
        proc.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    assert results == [(0, 3 * P, 3 * P, MATCH_CALLS + LOAD_CALLS),
                       (1, 3 * P, 3 * P, MATCH_CALLS + LOAD_CALLS)]
