"""A diagnostic, not a policy: LRU that knows which pages will never be used again.

Owns ``DeadFirstLRU``, an ``EvictionPolicy`` for replays only. It reads the future from the
trace: a leaf whose first block no later request uses is evicted before any other leaf (the
rest in LRU order). It answers "how much would knowing *whether* a page returns (but not when)
be worth?", separating the part of the gap to the offline bound that needs a predictor of reuse
from the part that needs a better ordering. Replay nodes hold block ids as uint32 tokens (one
page per block, as ``TraceRequest.block_bytes`` writes them, spread or raw), which is how it
maps a node to the trace. Main thread.
"""

from __future__ import annotations

import heapq
import itertools

from kvtier.index.eviction import LRUPolicy, Node
from kvtier.replay.trace import Trace


class DeadFirstLRU(LRUPolicy):
    """LRU, except that leaves with no future use go first. Call ``advance`` per request."""

    name = "dead-first-lru"

    def __init__(self, trace: Trace, spread_ids: bool = True) -> None:
        super().__init__()
        self._last_use: dict[bytes, int] = {}   # a page's identity -> its last request
        for i, request in enumerate(trace.requests):
            data = request.block_bytes(spread_ids)
            for at in range(0, len(data), 4):
                self._last_use[data[at:at + 4]] = i
        self.now = 0  # index of the request being served
        self._by_last: list[tuple[int, int, Node]] = []
        self._seq = itertools.count()

    def advance(self, requests: int = 1) -> None:
        """The replay finished ``requests`` requests (use as its progress callback)."""
        self.now += requests

    def _last(self, node: Node) -> int:
        tokens = getattr(node, "tokens", b"")
        return self._last_use.get(tokens[:4], -1) if tokens else -1

    def add(self, node: Node, pages: int) -> None:
        super().add(node, pages)
        heapq.heappush(self._by_last, (self._last(node), next(self._seq), node))

    def pop_victim(self) -> Node | None:
        while self._by_last and self._by_last[0][0] <= self.now:
            _, _, node = heapq.heappop(self._by_last)
            if node in self._leaves:
                self._leaves.discard(node)
                return node
        return super().pop_victim()
