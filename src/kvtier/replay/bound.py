"""The offline bound: what a cache that knows the future serves at a given capacity.

Owns ``offline_bound``: Belady's rule over prefix blocks — after each request, while the cache
holds more than ``capacity`` blocks, evict the block whose next use lies farthest in the future
(never-used-again blocks first). A block's next use is never earlier than its parent's (every
request that uses a block uses its whole prefix), and ties go to the deeper block, so the cached
set stays prefix-closed and every cached block is servable. With equal-size blocks and free
choice of what to keep this is the most block hits any policy can get, so it bounds every online
policy at the same capacity. (Breaking ties towards the shallower block instead evicts parents
before their children on a shared next use and serves a little less.) Pure Python, main thread.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.replay.trace import Trace

NEVER = 1 << 62


@dataclass(frozen=True)
class BoundResult:
    capacity_blocks: int
    served_tokens: int
    input_tokens: int

    @property
    def share(self) -> float:
        return self.served_tokens / max(self.input_tokens, 1)


def next_uses(trace: Trace) -> list[list[int]]:
    """For request ``i`` and its block ``j``: the index of the next request using that block
    (``NEVER`` if none)."""
    later: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in range(len(trace))]
    for i in range(len(trace) - 1, -1, -1):
        blocks = trace.requests[i].blocks
        out[i] = [later.get(b, NEVER) for b in blocks]
        for b in blocks:
            later[b] = i
    return out


def offline_bound(trace: Trace, capacity_blocks: int, uses: list[list[int]] | None = None,
                  progress: Callable[[int], None] | None = None) -> BoundResult:
    """Tokens served by Belady's rule with room for ``capacity_blocks`` blocks."""
    if capacity_blocks < 0:
        raise ValueError(f"capacity must be >= 0 blocks, got {capacity_blocks}")
    uses = next_uses(trace) if uses is None else uses
    held: dict[int, int] = {}            # block -> its next use
    depth_of: dict[int, int] = {}        # block -> its position in every chain it is in
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block); stale entries skipped
    served = 0
    for i, request in enumerate(trace.requests):
        blocks = request.blocks
        hit = 0
        while hit < len(blocks) and blocks[hit] in held:
            hit += 1
        served += request.served_tokens(hit, trace.block_tokens)
        for depth, (block, nxt) in enumerate(zip(blocks, uses[i], strict=True)):
            held[block] = nxt
            depth_of[block] = depth
            heapq.heappush(heap, (-nxt, -depth, block))
        while len(held) > capacity_blocks:
            neg_next, _, block = heapq.heappop(heap)
            if held.get(block) == -neg_next:
                del held[block]
                del depth_of[block]
        if len(heap) > 4 * len(held) + 1024:
            heap = [(-nxt, -depth_of[b], b) for b, nxt in held.items()]
            heapq.heapify(heap)
        if progress is not None:
            progress(1)
    return BoundResult(capacity_blocks, served, trace.input_tokens)
