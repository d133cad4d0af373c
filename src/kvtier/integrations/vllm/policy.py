"""kvtier's eviction ranking as a vLLM ``CachePolicy`` for vLLM's own CPU offloading pool.

Owns ``KvtierLRFU``: vLLM's CPU offload manager keeps chunk bookkeeping (which chunk holds which
key, transfer ref counts); this class decides which ready, unpinned chunk goes first, using
kvtier's ``lrfu`` policy (recency and frequency, with the decay tied to the pool's measured
eviction age; see ``kvtier.index.policies``). Load it with::

    "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", ...,
      "cache_policy": "KvtierLRFU", "cache_policy_module_path": "kvtier.integrations.vllm.policy"}

vLLM resolves the class by name from the module (its ``CachePolicyFactory``). Keys are vLLM's
``OffloadKey`` bytes, so the ranking sees flat chunks rather than kvtier's radix tree: a chunk
ranks by its own uses. Runs on vLLM's scheduler thread, like the rest of the offload manager.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvtier.index.eviction import make_eviction_policy
from kvtier.integrations.vllm.compat import require_offloading_plugins

require_offloading_plugins()      # before the vLLM import, which needs its tiering API

# ruff: noqa: E402  (vLLM's import follows the version check above)
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus


class KvtierLRFU(CachePolicy):
    """vLLM chunk bookkeeping with kvtier's ``lrfu`` victim order."""

    policy_name = "lrfu"

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.chunks: dict[bytes, ChunkStatus] = {}
        self._evictable: set[bytes] = set()
        self._ranking = make_eviction_policy(self.policy_name)

    def get(self, key: Any) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: Any, chunk: ChunkStatus) -> None:
        self.chunks[key] = chunk
        self._ranking.touch(key)
        if chunk.ref_cnt == 0:
            self.mark_evictable(key)

    def remove(self, key: Any) -> None:
        del self.chunks[key]
        self._evictable.discard(key)
        self._ranking.remove(key)
        self._ranking.forget(key)

    def touch(self, keys: Iterable[Any], req_context: Any) -> None:
        for key in keys:
            if key in self.chunks:
                self._ranking.touch(key)

    def mark_evictable(self, key: Any) -> None:
        if key in self.chunks and key not in self._evictable:
            self._evictable.add(key)
            self._ranking.add(key, 1)

    def mark_non_evictable(self, key: Any) -> None:
        self._evictable.discard(key)
        self._ranking.remove(key)

    def evict(self, n: int, protected: set[Any]) -> list[tuple[Any, ChunkStatus]] | None:
        """Exactly ``n`` ready, unpinned, unprotected chunks in kvtier's order, or None and no
        change when there are fewer."""
        if n == 0:
            return []
        candidates = [k for k in self._evictable
                      if k not in protected and self.chunks[k].ref_cnt == 0]
        if len(candidates) < n:
            return None
        chosen, skipped = [], []
        while len(chosen) < n:
            key = self._ranking.pop_victim()
            if key is None:
                break
            if key in protected or self.chunks[key].ref_cnt != 0:
                skipped.append(key)
                continue
            chosen.append((key, self.chunks.pop(key)))
            self._evictable.discard(key)
            self._ranking.forget(key)
        for key in skipped:
            self._ranking.add(key, 1)
        return chosen

    def clear(self) -> None:
        self.chunks.clear()
        self._evictable.clear()
        self._ranking = make_eviction_policy(self.policy_name)
