"""Per-tier residency: tier names, the index ``Node`` record, page-id pools and per-tier ledgers.

Owns the vocabulary the radix index is built from:

- ``TIERS``: device, host, disk, remote, fastest first (``TIER_INDEX`` maps name to position).
- ``Node``: one run of pages of the radix tree, with its tokens, keys, per-tier residency
  (``res[t]`` is ``None`` when tier ``t`` does not hold the run, else the run's page ids on that
  tier, or ``NO_IDS`` for a tier without page ids such as a store), per-tier path lock counts,
  hit count and last access (a logical clock).
- ``IdPool``: a small free-list of page ids for tiers that are bookkeeping-only (capacity in
  pages, no bytes), so the index runs without any pool or store.
- ``TierLedger``: what one tier holds: its allocator (``IdPool`` or a real pool's allocator with
  ``num_free``/``can_allocate``/``allocate``/``free``), its eviction policy, and the resident and
  protected page counts the index keeps up to date.

Pure Python, no torch; everything here runs on the engine thread.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias

from kvtier.errors import ConfigError, PoolExhausted
from kvtier.index.eviction import EvictionPolicy

TIERS: tuple[str, ...] = ("device", "host", "disk", "remote")
TIER_INDEX: dict[str, int] = {name: i for i, name in enumerate(TIERS)}
POOL_TIERS: tuple[str, ...] = ("device", "host")
STORE_TIERS: tuple[str, ...] = ("disk", "remote")

#: Residency marker for a tier that holds a run without page ids (a store known by flag).
NO_IDS: tuple[int, ...] = ()
#: What a node records for one tier: its page ids (tiers with ids) or ``NO_IDS``.
Ids: TypeAlias = "array[int] | tuple[int, ...]"


def tier_index(tier: str) -> int:
    try:
        return TIER_INDEX[tier]
    except KeyError:
        raise ConfigError("tier", tier, ", ".join(TIERS)) from None


class Allocator(Protocol):
    """What the index needs from a page pool's allocator (``kvtier.memory`` or ``IdPool``)."""

    @property
    def num_free(self) -> int: ...

    def can_allocate(self, n: int) -> bool: ...

    def allocate(self, n: int) -> list[int]: ...

    def free(self, ids: Iterable[int]) -> None: ...


class IdPool:
    """Page ids ``0..capacity-1`` handed out from a free list (bookkeeping-only tiers)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ConfigError("capacity", capacity, "an integer >= 0")
        self.capacity = capacity
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._used = bytearray(capacity)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise PoolExhausted(f"asked for {n} pages, {len(self._free)} free of {self.capacity}")
        out = [self._free.pop() for _ in range(n)]
        for i in out:
            self._used[i] = 1
        return out

    def free(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        for i in ids:
            if not 0 <= i < self.capacity or not self._used[i]:
                raise ValueError(f"page id {i} is not allocated")
            self._used[i] = 0
        self._free.extend(ids)

    def is_allocated(self, page_id: int) -> bool:
        return 0 <= page_id < self.capacity and bool(self._used[page_id])


class Node:
    """A run of ``pages`` consecutive pages of one prefix path in the radix tree."""

    __slots__ = ("parent", "children", "tokens", "keys", "pages", "res", "mask", "locks", "kids",
                 "hits", "last_access", "salt", "__weakref__")

    def __init__(self, parent: Node | None, tokens: bytes, keys: bytes, pages: int,
                 salt: bytes) -> None:
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.tokens = tokens          # pages * page_size uint32 little-endian token ids
        self.keys = keys              # pages * 32 bytes of PageKey, or b"" when keyless
        self.pages = pages
        self.res: list[Ids | None] = [None] * len(TIERS)
        self.mask = 0                  # bit t set <=> res[t] is not None (fast walks)
        self.locks = [0] * len(TIERS)  # path locks: every lock below passes through here
        self.kids = [0] * len(TIERS)   # children resident on each tier
        self.hits = 0
        self.last_access = 0
        self.salt = salt

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def resident(self, t: int) -> bool:
        return self.res[t] is not None

    def anywhere(self) -> bool:
        return any(r is not None for r in self.res)

    def best_tier(self) -> int:
        """Position in ``TIERS`` of the fastest tier holding the run (``len(TIERS)``: none)."""
        for t, r in enumerate(self.res):
            if r is not None:
                return t
        return len(TIERS)

    def ids(self, tier: str) -> list[int]:
        """Page ids of the run on ``tier`` (empty if not resident or the tier has no ids)."""
        r = self.res[tier_index(tier)]
        return [] if r is None else list(r)

    def __repr__(self) -> str:
        where = ",".join(TIERS[t] for t, r in enumerate(self.res) if r is not None) or "-"
        return f"Node(pages={self.pages}, on={where}, locks={self.locks}, hits={self.hits})"


def make_ids(ids: Sequence[int] | None) -> Ids:
    """The residency value for a run: an int64 array of ids, or ``NO_IDS``."""
    return NO_IDS if ids is None else array("q", ids)


def slice_ids(value: Ids | None, start: int, stop: int) -> Ids | None:
    if value is None or value is NO_IDS:
        return value
    return value[start:stop]


@dataclass(frozen=True)
class TierSizes:
    """Pages one tier holds for the index: resident = evictable + protected."""

    tier: str
    resident: int
    evictable: int
    protected: int
    capacity: int | None
    free: int | None


class TierLedger:
    """One tier's allocator, eviction policy and page counts."""

    def __init__(self, name: str, policy: EvictionPolicy, allocator: Allocator | None = None,
                 capacity: int | None = None) -> None:
        self.name = name
        self.index = tier_index(name)
        self.policy = policy
        self.allocator = allocator
        self.capacity = capacity
        self.resident = 0
        self.protected = 0

    @property
    def evictable(self) -> int:
        return self.resident - self.protected

    @property
    def has_ids(self) -> bool:
        return self.allocator is not None

    def free_pages(self) -> int | None:
        return None if self.allocator is None else self.allocator.num_free

    def sizes(self) -> TierSizes:
        return TierSizes(self.name, self.resident, self.evictable, self.protected,
                         self.capacity, self.free_pages())
