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
from kvtier.index.insert import InsertWalk
from kvtier.index.integrity import check_index
from kvtier.index.match import IndexMatch, InsertResult
from kvtier.index.residency import TIERS, Allocator, Node, TierLedger, TierSizes, tier_index
from kvtier.index.tree import EvictHook, ResidencyObserver, Tree
from kvtier.keys import Tokens, token_bytes

__all__ = ["EvictHook", "RadixIndex", "ResidencyObserver", "as_token_bytes", "salt_bytes"]

_ALL_TIERS = (1 << len(TIERS)) - 1


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
        """The longest indexed prefix of ``tokens`` and each tier's depth along it."""
        data = as_token_bytes(tokens)
        key = salt_bytes(salt)
        path: list[tuple[Node, int]] = []
        depth = [0] * len(TIERS)
        mask = _ALL_TIERS  # tiers holding every page walked so far
        node = self._roots.get(key)
        pos, step = 0, self._step
        full = len(data) // step
        startswith, append = data.startswith, path.append
        while node is not None and pos < full:
            offset = pos * step
            child = node.children.get(data[offset:offset + step])
            if child is None:
                break
            used = child.pages
            if used > full - pos or not startswith(child.tokens, offset):
                used = self._common_pages(child, data, pos, full - pos)
            append((child, used))
            if child.mask & mask != mask:
                for t in range(len(TIERS)):
                    if mask >> t & 1 and not child.mask >> t & 1:
                        depth[t] = pos
                mask &= child.mask
            pos += used
            node = child if used == child.pages else None
        for t in range(len(TIERS)):
            if mask >> t & 1:
                depth[t] = pos
        return IndexMatch(key, self.page_size, data, pos, tuple(depth), tuple(path), self.version)

    def _common_pages(self, node: Node, data: bytes, pos: int, limit: int) -> int:
        """Leading pages of ``node`` equal to the prompt's pages from ``pos`` (first page known)."""
        step = self._step
        n = min(node.pages, limit)
        if data.startswith(node.tokens if n == node.pages else node.tokens[:n * step], pos * step):
            return n
        used = 1
        while used < n and data.startswith(node.tokens[used * step:(used + 1) * step],
                                           (pos + used) * step):
            used += 1
        return used

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
               start: int = 0, stop: int | None = None, strict: bool = True) -> InsertResult:
        """Put prefix pages ``[start, stop)`` of ``tokens`` on ``tier`` (``ids[i]`` for page
        ``start + i`` on tiers with page ids), creating nodes for pages the tree lacks.

        Pages the tier already holds keep their ids; differing ``ids`` come back as unused.
        The range must keep the tier prefix-closed (page ``start - 1`` on the tier) and new
        nodes must get the tier (``start`` <= the indexed depth): otherwise a strict insert
        raises ``ValueError`` and a lenient one stops there and returns the rest as unused.
        """
        data = as_token_bytes(tokens)
        t = tier_index(tier)
        ledger = self.ledgers[t]
        stop = len(data) // self._step if stop is None else stop
        self._check_insert_args(ledger, data, keys, ids, start, stop)
        self._clock += 1
        root = self._root(salt_bytes(salt))
        walk = InsertWalk(self, data, keys, t, ids, start, stop, strict)
        try:
            node = walk.run(root)
        finally:
            if not root.children and root.salt:
                del self._roots[root.salt]
        return InsertResult(node, walk.taken, walk.unused, walk.pos)

    def _check_insert_args(self, ledger: TierLedger, data: bytes, keys: Sequence[bytes] | None,
                           ids: Sequence[int] | None, start: int, stop: int) -> None:
        if not 0 <= start <= stop <= len(data) // self._step:
            raise ValueError(f"page range [{start}, {stop}) outside the prompt's "
                             f"{len(data) // self._step} full pages")
        if ledger.has_ids != (ids is not None):
            need = "needs page ids" if ledger.has_ids else "takes no page ids"
            raise ValueError(f"tier {ledger.name} {need}")
        if ids is not None and len(ids) != stop - start:
            raise ValueError(f"{len(ids)} ids for {stop - start} pages")
        if keys is not None and len(keys) < stop:
            raise ValueError(f"{len(keys)} keys for {stop} pages")
    def current(self, match: IndexMatch) -> IndexMatch:
        """``match`` itself while the index has not changed since that walk, else a new walk."""
        if match.version == self.version:
            return match
        return self.match(match.data, match.salt)

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
