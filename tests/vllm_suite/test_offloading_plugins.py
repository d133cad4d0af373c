"""kvtier's secondary tier and eviction policy through vLLM's own offloading factories.

vLLM's ``OffloadingConnector`` refuses to start on the CPU platform, so these run one level
down: the tier is built by vLLM's ``SecondaryTierFactory`` over a pool-shaped buffer, and the
policy by ``CachePolicyFactory`` inside vLLM's real ``CPUOffloadingManager``.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.metrics.cache_hit_source import CacheHitSource

CHUNKS, CHUNK_BYTES = 8, 4096
TIER = {"type": "KvtierSecondaryTier", "module_path": "kvtier.integrations.vllm.tiers"}
CTX = ReqContext(req_id="r0")


def _tier(pool: np.ndarray, url: str):
    spec = SimpleNamespace(vllm_config=SimpleNamespace(model_config=SimpleNamespace(model="m")))
    return SecondaryTierFactory.create_secondary_tier(dict(TIER, url=url), memoryview(pool), spec)


def _finish(tier, timeout_s: float = 10.0) -> list:
    tier.drain_jobs()
    deadline, results = time.monotonic() + timeout_s, []
    while not results and time.monotonic() < deadline:
        results = list(tier.get_finished_jobs())
    return results


def _keys(*names: str) -> list[bytes]:
    return [name.encode().ljust(36, b"\0") for name in names]


@pytest.fixture
def pool() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, 255, size=(CHUNKS, CHUNK_BYTES), dtype=np.uint8)


def test_chunks_stored_on_disk_load_back_in_a_fresh_tier(pool, tmp_path: Path):
    url = f"file://{tmp_path / 'tier'}"
    tier = _tier(pool, url)
    assert tier.cache_hit_source == CacheHitSource.DISK
    original = pool[:3].copy()
    tier.submit_store(TransferJob(1, _keys("a", "b", "c"), np.array([0, 1, 2]), False, CTX))
    (stored,) = _finish(tier)
    assert stored.success and stored.job_id == 1
    tier.shutdown()
    again = _tier(pool, url)                  # another process's view: the store's own index
    assert again.lookup(_keys("b")[0], CTX) == LookupResult.HIT
    assert again.lookup(_keys("z")[0], CTX) == LookupResult.MISS
    pool[5:8] = 0
    again.submit_load(TransferJob(2, _keys("c", "a", "b"), np.array([5, 6, 7]), True, CTX))
    (loaded,) = _finish(again)
    assert loaded.success
    assert np.array_equal(pool[5:8], original[[2, 0, 1]])
    again.shutdown()


def test_a_load_of_a_missing_chunk_is_a_failed_job_not_an_error(pool, tmp_path: Path):
    tier = _tier(pool, f"file://{tmp_path / 'tier'}")
    tier.submit_store(TransferJob(1, _keys("a"), np.array([0]), False, CTX))
    _finish(tier)
    tier.submit_load(TransferJob(2, _keys("a", "missing"), np.array([3, 4]), True, CTX))
    (result,) = _finish(tier)
    assert not result.success and list(result.successful_keys) == _keys("a")
    tier.shutdown()


def test_a_tier_without_a_url_is_refused_at_start(pool):
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError, match="url"):
        _tier(pool, "")


def _manager(chunks: int) -> CPUOffloadingManager:
    return CPUOffloadingManager(chunks, cache_policy="KvtierLRFU",
                                cache_policy_module_path="kvtier.integrations.vllm.policy")


def _store(manager: CPUOffloadingManager, keys: list[bytes]):
    out = manager.prepare_store(keys, CTX)
    manager.complete_store(out.keys_to_store, CTX)
    return out


def test_the_policy_evicts_the_chunk_unused_longest_in_vllms_manager():
    manager = _manager(3)
    a, b, c, d = _keys("a", "b", "c", "d")
    _store(manager, [a, b, c])
    manager.prepare_load([a], CTX)
    manager.complete_load([a], CTX)
    manager.touch([a], CTX)
    out = _store(manager, [d])
    assert out.evicted_keys == [b]
    assert manager.lookup(a, CTX) == LookupResult.HIT and manager.lookup(b, CTX) == LookupResult.MISS


def test_the_policy_never_evicts_a_chunk_being_read():
    manager = _manager(2)
    a, b, c = _keys("a", "b", "c")
    _store(manager, [a, b])
    manager.prepare_load([a], CTX)            # a is pinned by an in-flight load
    out = _store(manager, [c])
    assert out.evicted_keys == [b]
    assert manager.prepare_store(_keys("e", "f"), CTX) is None    # only c is evictable


def test_an_eviction_that_cannot_be_met_changes_nothing():
    from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    cls = CachePolicyFactory.get_cache_policy_cls("KvtierLRFU", "kvtier.integrations.vllm.policy")
    policy = cls(cache_capacity=4)
    a, b = _keys("a", "b")
    for i, key in enumerate((a, b)):
        chunk = ChunkStatus(i)
        chunk.ref_cnt = 0
        policy.insert(key, chunk)
    assert policy.evict(3, set()) is None
    b_chunk = policy.get(b)
    assert policy.evict(1, {a}) == [(b, b_chunk)]
    assert policy.get(a) is not None and policy.get(b) is None
