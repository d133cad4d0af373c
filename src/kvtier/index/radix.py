"""The radix index: which token pages exist, and on which tiers (device, host, disk, remote).

Owns ``RadixIndex``, a page-granular radix tree per tenant salt. A node is a run of whole pages;
its children are keyed by their first page's token bytes, so a lookup compares the tokens a page
was computed for byte by byte and never trusts a hash alone. Each node records per tier whether
the tier holds the run (with the run's page ids on tiers that have them), a path lock count per
tier, a hit count and a last-access clock.

Invariants (``check_integrity`` verifies all of them):

- every tier's resident set is prefix-closed: a node is on a tier only if its parent is (a store
  holds a prefix contiguous from the root; a device prefix is usable as one run of pages);
- every node is held by at least one tier (a node held nowhere is removed at once);
- a tier's ``resident`` pages = ``evictable`` + ``protected``; protected pages are on nodes with
  a lock on that tier; locks are path locks (locking a node locks its ancestors);
- a tier's eviction policy holds exactly the tier's evictable leaves: resident, unlocked, and
  with no child resident on that tier. Eviction removes whole nodes, leaf first, never a locked
  one, and either frees the pages asked for or evicts nothing.

The index works with no pool or store at all: give ``capacities`` in pages and it hands out page
ids itself (``IdPool``); give ``allocators`` (a pool's ``PageAllocator``) to share real pools.
Single-threaded: the engine thread owns it. No torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import cast

from kvtier.errors import PoolExhausted
from kvtier.index.insert import InsertWalk, check_insert_args
from kvtier.index.integrity import check_index
from kvtier.index.match import IndexMatch, InsertResult
from kvtier.index.residency import Allocator, Node, TierLedger, TierSizes, tier_index
from kvtier.index.tree import EvictHook, ResidencyObserver, Tree
from kvtier.index.walk import Depths, Path, descend
from kvtier.keys import Tokens, token_bytes

__all__ = ["EvictHook", "RadixIndex", "ResidencyObserver", "as_token_bytes", "salt_bytes"]


def as_token_bytes(tokens: Tokens) -> bytes:
    """Token ids as uint32 little-endian bytes (bytes pass through unchanged)."""
    if isinstance(tokens, bytes):
        return tokens
    if isinstance(tokens, (bytearray, memoryview)):
        return bytes(tokens)
    return token_bytes(tokens)


def salt_bytes(salt: bytes | str | None) -> bytes:
    if salt is None:
        return b""
    return salt.encode("utf-8") if isinstance(salt, str) else bytes(salt)


class RadixIndex(Tree):
    """Radix tree over token pages with per-tier residency, path locks and per-tier eviction.

    ``RadixIndex(page_size, allocators=None, capacities=None, policies="lru", on_evict=None)``:
    ``policies`` is one policy name for every tier or a mapping tier -> name or instance;
    ``on_evict(node, tier)`` runs before each victim leaves a tier; ``observer`` (a
    ``ResidencyObserver``, None by default) hears every residency change after it happens.
    """

    # ---- lookup (no mutation) ------------------------------------------------------------
    def match(self, tokens: Tokens, salt: bytes | str | None = None) -> IndexMatch:
        """The longest indexed prefix of ``tokens`` and each tier's depth along it (a walk
        from the salt's root)."""
        data = as_token_bytes(tokens)
        key = salt_bytes(salt)
        return self._walk_on(key, data, self._roots.get(key), 0, [])

    def _walk_on(self, key: bytes, data: bytes, node: Node | None, pos: int,
                 path: Path) -> IndexMatch:
        """The match of ``data`` walked on down from ``node`` (ending at page ``pos``, reached
        along ``path``, which grows to the end of the walk)."""
        depths = Depths().over(path)
        pages = descend(node, data, pos, path, self._step, depths)
        return IndexMatch(key, self.page_size, data, pages, depths.at(pages), tuple(path),
                          self.version)

    def touch(self, match: IndexMatch) -> None:
        """Record that a request used the matched prefix (hits, recency, every tier's policy)."""
        self._clock += 1
        for node, _ in match.path:
            node.hits += 1
            node.last_access = self._clock
            for ledger in self.ledgers:
                ledger.policy.touch(node)
    # ---- insert --------------------------------------------------------------------------
    def insert(self, tokens: Tokens, keys: Sequence[bytes] | None = None, *, tier: str,
               ids: Sequence[int] | None = None, salt: bytes | str | None = None,
               start: int = 0, stop: int | None = None, strict: bool = True,
               after: IndexMatch | None = None) -> InsertResult:
        """Put prefix pages ``[start, stop)`` of ``tokens`` on ``tier`` (``ids[i]`` for page
        ``start + i`` on tiers with page ids), creating nodes for pages the tree lacks.

        Pages the tier already holds keep their ids; differing ``ids`` come back as unused.
        The range must keep the tier prefix-closed (page ``start - 1`` on the tier) and new
        nodes must get the tier (``start`` <= the indexed depth): otherwise a strict insert
        raises ``ValueError`` and a lenient one stops there and returns the rest as unused.

        ``after`` (a walk of these tokens, or of a prompt they extend, with the same salt)
        makes the insert follow that walk's path (``extend``) instead of walking from the
        root, and the result then carries the walk of ``tokens`` as it stands after the
        insert (``InsertResult.match``).
        """
        data = as_token_bytes(tokens)
        t = tier_index(tier)
        ledger = self.ledgers[t]
        stop = len(data) // self._step if stop is None else stop
        check_insert_args(ledger, len(data) // self._step, keys, ids, start, stop)
        key = salt_bytes(salt)
        along = self.extend(after, data, key).path if after is not None else ()
        self._clock += 1
        root = self._root(key)
        walk = InsertWalk(self, data, keys, t, ids, start, stop, strict)
        try:
            node = walk.run(root, along)
        finally:
            if not root.children and root.salt:
                del self._roots[root.salt]
        walked = None
        if after is not None:
            walked = self._walk_on(key, data, walk.at, walk.pos, walk.path)
        return InsertResult(node, walk.taken, walk.unused, walk.pos, walked)

    def current(self, match: IndexMatch) -> IndexMatch:
        """``match`` itself while the index has not changed since that walk, else a new walk."""
        if match.version == self.version:
            return match
        return self.match(match.data, match.salt)

    def extend(self, match: IndexMatch, tokens: Tokens, salt: bytes | str | None = None
               ) -> IndexMatch:
        """The walk of ``tokens`` (the same tokens as ``match`` walked over the shorter of the
        two, e.g. a prompt and its generated tokens) continued from where ``match`` left the
        tree: the answer of ``match(tokens, salt)`` without walking its prefix again. A stale
        ``match`` is walked again first (``current``); other tokens or salt, from the root."""
        data, key = as_token_bytes(tokens), salt_bytes(salt)
        if match.salt != key:
            return self.match(data, key)
        match = self.current(match)
        if match.data is data:
            return match
        n = min(len(match.data), len(data)) // self._step * self._step
        if match.data[:n] != data[:n]:
            return self.match(data, key)
        full = len(data) // self._step
        path: Path = []
        node, pos = self._roots.get(key), 0
        for child, used in match.path:  # the nodes it used whole (and the tokens hold whole)
            if used != child.pages or pos + used > full:
                break
            path.append((child, used))
            node, pos = child, pos + used
        return self._walk_on(key, data, node, pos, path)

    def boundary(self, tokens: Tokens, pages: int, salt: bytes | str | None = None) -> Node | None:
        """The node ending exactly after prefix page ``pages`` (splitting one if needed)."""
        if pages == 0:
            return None
        return self.cut(self.match(tokens, salt), pages)[0]

    def cut(self, match: IndexMatch, pages: int) -> tuple[Node | None, IndexMatch]:
        """``boundary`` over a walk already made: the node ending after prefix page ``pages``
        of ``match`` (split off if needed), and the match as it stands after that split."""
        if pages == 0:
            return None, match
        match = self.current(match)
        if match.pages < pages:
            raise ValueError(f"only {match.pages} pages are indexed, asked for {pages}")
        pos = 0
        for i, (node, used) in enumerate(match.path):
            if pos + node.pages >= pages:
                if pos + node.pages == pages:
                    return node, match
                head_pages = pages - pos
                head = self.split(node, head_pages)
                tail = ((node, used - head_pages),) if used > head_pages else ()
                path = match.path[:i] + ((head, head_pages),) + tail + match.path[i + 1:]
                return head, replace(match, path=path, version=self.version)
            pos += node.pages
        raise AssertionError("unreachable: match covered the pages")

    def evict(self, tier: str, pages: int, *, use_hook: bool = True) -> int:
        """Free at least ``pages`` pages of ``tier`` by evicting whole leaves in policy order.

        All or nothing: returns 0 and evicts nothing if the tier's evictable pages fall short.
        ``on_evict(node, tier)`` runs before each victim is dropped (write-back hooks in here).
        """
        t = tier_index(tier)
        ledger = self.ledgers[t]
        if pages <= 0 or ledger.evictable < pages:
            return 0
        freed = 0
        while freed < pages:
            victim = cast("Node | None", ledger.policy.pop_victim())
            if victim is None:
                raise AssertionError(f"{tier}: policy empty with {ledger.evictable} evictable")
            if use_hook and self.on_evict is not None:
                self.on_evict(victim, tier)
            freed += self._release(victim, t)
        return freed

    def clear(self, tier: str) -> int:
        """Evict every evictable page of ``tier`` (no hooks); locked pages stay."""
        return self.clear_tiers((tier,))[tier]

    def clear_tiers(self, tiers: Sequence[str]) -> dict[str, int]:
        """``clear`` each tier; an observer hears one ``cleared`` for all instead of each removal."""
        observer = self.observer
        if observer is not None:
            observer.paused = True
        try:
            return {tier: self.evict(tier, self.sizes(tier).evictable, use_hook=False)
                    for tier in tiers}
        finally:
            if observer is not None:
                observer.paused = False
                observer.cleared(self)
    # ---- page ids ----------------------------------------------------------------------------
    def can_allocate(self, tier: str, n: int) -> bool:
        ledger, allocator = self._with_ids(tier)
        return allocator.num_free + ledger.evictable >= n

    def allocate(self, tier: str, n: int) -> list[int]:
        """``n`` page ids of ``tier``, evicting as needed; PoolExhausted (nothing evicted) if
        even evicting everything evictable would not make room."""
        ledger, allocator = self._with_ids(tier)
        if allocator.num_free + ledger.evictable < n:
            raise PoolExhausted(f"{tier}: {n} pages asked, {allocator.num_free} free, "
                                f"{ledger.evictable} evictable")
        short = n - allocator.num_free
        if short > 0:
            self.evict(tier, short)
        return allocator.allocate(n)

    def _with_ids(self, tier: str) -> tuple[TierLedger, Allocator]:
        ledger = self.ledgers[tier_index(tier)]
        if ledger.allocator is None:
            raise ValueError(f"tier {tier} has no page ids")
        return ledger, ledger.allocator

    def free(self, tier: str, ids: Sequence[int]) -> None:
        """Return ids the index never took (unused ids of an insert, say) to the tier's pool."""
        ledger = self.ledgers[tier_index(tier)]
        if ids and ledger.allocator is not None:
            ledger.allocator.free(list(ids))
    # ---- inspection ----------------------------------------------------------------------------
    def sizes(self, tier: str) -> TierSizes:
        return self.ledgers[tier_index(tier)].sizes()

    def stats(self) -> dict[str, object]:
        nodes = sum(1 for _ in self.iter_nodes())
        return {"nodes": nodes, "salts": len(self._roots),
                "tiers": {ledger.name: vars(ledger.sizes()) for ledger in self.ledgers}}

    def check_integrity(self, outstanding: Mapping[str, int] | None = None) -> None:
        """Raise AssertionError naming the first broken invariant (see the module docstring).

        ``outstanding`` (tier -> pages) adds a conservation law for pools: pages the allocator
        has handed out = pages the index holds + pages held outside it (jobs, requests).
        """
        check_index(self, outstanding)
