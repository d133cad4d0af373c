"""Results of radix-index lookups and inserts: ``IndexMatch`` and ``InsertResult``.

Owns the read-only views the index hands out. An ``IndexMatch`` is a snapshot of one walk: the
path of nodes a prompt matched, how many of its pages each tier holds (a tier's resident set is
prefix-closed, so each tier's share is a depth from the root), and accessors for the page ids
and keys of that prefix. It holds node references for immediate use on the engine thread; after
any mutation of the index, walk again (``RadixIndex.current`` does so only when the
index changed since). Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.index.residency import NO_IDS, TIERS, Node, tier_index
from kvtier.keys import KEY_BYTES, PageKey


@dataclass(frozen=True)
class IndexMatch:
    """The prefix of a prompt that the index knows, and which tier holds how much of it."""

    salt: bytes
    page_size: int
    data: bytes                              # the prompt's tokens, uint32 little-endian
    pages: int                               # pages matched in the tree (each held somewhere)
    depth: tuple[int, ...]                   # per tier (TIERS order): pages held from the root
    path: tuple[tuple[Node, int], ...] = field(repr=False)  # (node, pages of it used), root-down
    version: int = -1                        # the index's version when walked (-1: unknown)

    @property
    def prompt_pages(self) -> int:
        """Full pages of the prompt (a partial last page never matches)."""
        return len(self.data) // (4 * self.page_size)

    def depth_of(self, tier: str) -> int:
        return self.depth[tier_index(tier)]

    def tokens_on(self, tier: str) -> int:
        return self.depth_of(tier) * self.page_size

    def reach(self, tiers: tuple[str, ...] = TIERS) -> int:
        """Pages held from the root by at least one of ``tiers``."""
        return max((self.depth[tier_index(t)] for t in tiers), default=0)

    def ids(self, tier: str, start: int = 0, stop: int | None = None) -> list[int]:
        """Page ids on ``tier`` of prefix pages ``[start, stop)`` (stop <= that tier's depth)."""
        t = tier_index(tier)
        stop = self.depth[t] if stop is None else stop
        if not 0 <= start <= stop <= self.depth[t]:
            raise ValueError(f"pages [{start}, {stop}) are not all on {tier} "
                             f"(it holds {self.depth[t]})")
        out: list[int] = []
        pos = 0
        for node, used in self.path:
            lo, hi = max(start, pos), min(stop, pos + used)
            if lo < hi:
                value = node.res[t]
                if value is NO_IDS:
                    raise ValueError(f"tier {tier} has no page ids")
                assert value is not None, "a node within a tier's depth is on that tier"
                out.extend(value[lo - pos:hi - pos])
            pos += used
            if pos >= stop:
                break
        return out

    def keys(self, start: int = 0, stop: int | None = None) -> list[PageKey]:
        """Page keys of matched pages ``[start, stop)`` (keyless nodes raise ValueError)."""
        stop = self.pages if stop is None else stop
        if not 0 <= start <= stop <= self.pages:
            raise ValueError(f"pages [{start}, {stop}) outside the {self.pages} matched")
        out: list[PageKey] = []
        pos = 0
        for node, used in self.path:
            lo, hi = max(start, pos), min(stop, pos + used)
            if lo < hi:
                if not node.keys:
                    raise ValueError("the index holds no keys for this prefix")
                raw = node.keys[(lo - pos) * KEY_BYTES:(hi - pos) * KEY_BYTES]
                out.extend(PageKey(raw[i:i + KEY_BYTES]) for i in range(0, len(raw), KEY_BYTES))
            pos += used
            if pos >= stop:
                break
        return out

    def last_key(self) -> bytes | None:
        """Key of the last matched page (to continue the key chain past it), or None."""
        if not self.path:
            return None
        node, used = self.path[-1]
        if not node.keys:
            return None
        return node.keys[(used - 1) * KEY_BYTES:used * KEY_BYTES]

    def nodes(self) -> list[Node]:
        return [node for node, _ in self.path]


@dataclass(frozen=True)
class InsertResult:
    """What an insert did: the deepest node of the range, pages that took the tier, and the ids
    the index did not take (pages the tier already held under other ids, or a range it refused)."""

    node: Node | None
    taken: int
    unused_ids: list[int]
    stopped_at: int   # first page not covered (== stop unless a lenient insert stopped early)
    match: IndexMatch | None = None   # the walk of the tokens after the insert (given ``after``)
