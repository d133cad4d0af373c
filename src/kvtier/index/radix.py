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

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from kvtier.errors import PoolExhausted
from kvtier.index.eviction import EvictionPolicy, make_eviction_policy
from kvtier.index.integrity import check_index
from kvtier.index.match import IndexMatch, InsertResult
from kvtier.index.residency import (
    NO_IDS,
    TIERS,
    Allocator,
    IdPool,
    Node,
    TierLedger,
    TierSizes,
    make_ids,
    slice_ids,
    tier_index,
)
from kvtier.keys import KEY_BYTES, token_bytes

EvictHook = Callable[[Node, str], None]
_ALL_TIERS = (1 << len(TIERS)) - 1


def as_token_bytes(tokens: Any) -> bytes:
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


class RadixIndex:
    """Radix tree over token pages with per-tier residency, path locks and per-tier eviction."""

    def __init__(self, page_size: int, *, allocators: Mapping[str, Allocator] | None = None,
                 capacities: Mapping[str, int] | None = None,
                 policies: str | Mapping[str, str | EvictionPolicy] = "lru",
                 on_evict: EvictHook | None = None) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._step = page_size * 4
        self._roots: dict[bytes, Node] = {}
        self._clock = 0
        self.on_evict = on_evict
        self.ledgers: tuple[TierLedger, ...] = tuple(
            self._make_ledger(tier, allocators or {}, capacities or {}, policies) for tier in TIERS)

    @staticmethod
    def _make_ledger(tier: str, allocators: Mapping[str, Allocator], capacities: Mapping[str, int],
                     policies: str | Mapping[str, str | EvictionPolicy]) -> TierLedger:
        spec = policies if isinstance(policies, str) else policies.get(tier, "lru")
        policy = make_eviction_policy(spec) if isinstance(spec, str) else spec
        allocator = allocators.get(tier)
        capacity = capacities.get(tier)
        if allocator is None and capacity is not None:
            allocator = IdPool(capacity)
        return TierLedger(tier, policy, allocator, capacity)

    # ---- lookup (no mutation) ------------------------------------------------------------
    def match(self, tokens: Any, salt: bytes | str | None = None) -> IndexMatch:
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
        return IndexMatch(key, self.page_size, data, pos, tuple(depth), tuple(path))

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
    def insert(self, tokens: Any, keys: Sequence[bytes] | None = None, *, tier: str,
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
        walk = _InsertWalk(self, data, keys, t, ids, start, stop, strict)
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

    def _root(self, key: bytes) -> Node:
        root = self._roots.get(key)
        if root is None:
            root = self._roots[key] = Node(None, b"", b"", 0, key)
        return root

    def _new_node(self, parent: Node, data: bytes, keys: Sequence[bytes] | None, lo: int,
                  hi: int) -> Node:
        raw = b"".join(bytes(k) for k in keys[lo:hi]) if keys is not None else b""
        node = Node(parent, data[lo * self._step:hi * self._step], raw, hi - lo, parent.salt)
        node.hits = 1
        node.last_access = self._clock
        parent.children[node.tokens[:self._step]] = node
        return node

    def split(self, node: Node, pages: int) -> Node:
        """Cut ``node`` after ``pages`` pages; returns the new node holding the first part.

        ``node`` keeps the rest (so references to it, and locks taken through it, stay valid).
        """
        if not 0 < pages < node.pages:
            raise ValueError(f"cannot split a run of {node.pages} pages at {pages}")
        cut = pages * self._step
        parent = node.parent
        assert parent is not None
        head = Node(parent, node.tokens[:cut], node.keys[:pages * KEY_BYTES], pages, node.salt)
        for t in range(len(TIERS)):
            head.res[t] = slice_ids(node.res[t], 0, pages)
            node.res[t] = slice_ids(node.res[t], pages, node.pages)
            head.kids[t] = 1 if node.res[t] is not None else 0
        head.mask = node.mask
        head.locks = list(node.locks)
        head.hits, head.last_access = node.hits, node.last_access
        node.tokens, node.keys = node.tokens[cut:], node.keys[pages * KEY_BYTES:]
        node.pages -= pages
        parent.children[head.tokens[:self._step]] = head
        head.children[node.tokens[:self._step]] = node
        node.parent = head
        return head

    def boundary(self, tokens: Any, pages: int, salt: bytes | str | None = None) -> Node | None:
        """The node ending exactly after prefix page ``pages`` (splitting one if needed)."""
        if pages == 0:
            return None
        match = self.match(tokens, salt)
        if match.pages < pages:
            raise ValueError(f"only {match.pages} pages are indexed, asked for {pages}")
        pos = 0
        for node, _used in match.path:
            if pos + node.pages >= pages:
                return node if pos + node.pages == pages else self.split(node, pages - pos)
            pos += node.pages
        raise AssertionError("unreachable: match covered the pages")

    # ---- residency transitions (keep counts and policy membership exact) -----------------
    def _set(self, node: Node, t: int, value: Any) -> None:
        ledger = self.ledgers[t]
        node.res[t] = value
        node.mask |= 1 << t
        ledger.resident += node.pages
        if node.locks[t]:
            ledger.protected += node.pages
        parent = node.parent
        if parent is not None and parent.parent is not None:
            parent.kids[t] += 1
            if parent.kids[t] == 1:
                ledger.policy.remove(parent)
        if not node.locks[t] and not node.kids[t]:
            ledger.policy.add(node, node.pages)

    def _unset(self, node: Node, t: int) -> Any:
        ledger = self.ledgers[t]
        value = node.res[t]
        node.res[t] = None
        node.mask &= ~(1 << t)
        ledger.resident -= node.pages
        if node.locks[t]:
            ledger.protected -= node.pages
        ledger.policy.remove(node)
        parent = node.parent
        if parent is not None and parent.parent is not None:
            parent.kids[t] -= 1
            if not parent.kids[t] and parent.res[t] is not None and not parent.locks[t]:
                ledger.policy.add(parent, parent.pages)
        return value

    def _delete(self, node: Node) -> None:
        """Remove a node held nowhere (and therefore without children) from the tree."""
        assert not node.children and not node.anywhere(), node
        parent = node.parent
        assert parent is not None
        del parent.children[node.tokens[:self._step]]
        for ledger in self.ledgers:
            ledger.policy.forget(node)
        if parent.parent is None and not parent.children and parent.salt:
            del self._roots[parent.salt]

    # ---- locks ---------------------------------------------------------------------------
    def lock(self, node: Node | None, tier: str) -> None:
        """Protect ``node`` and its ancestors on ``tier`` from eviction (counted; unlock once)."""
        t = tier_index(tier)
        ledger = self.ledgers[t]
        while node is not None and node.parent is not None:
            node.locks[t] += 1
            if node.locks[t] == 1 and node.res[t] is not None:
                ledger.protected += node.pages
                ledger.policy.remove(node)
            node = node.parent

    def unlock(self, node: Node | None, tier: str) -> None:
        t = tier_index(tier)
        ledger = self.ledgers[t]
        while node is not None and node.parent is not None:
            if node.locks[t] < 1:
                raise ValueError(f"unlock of an unlocked node on {tier}: {node!r}")
            node.locks[t] -= 1
            if node.locks[t] == 0 and node.res[t] is not None:
                ledger.protected -= node.pages
                if not node.kids[t]:
                    ledger.policy.add(node, node.pages)
            node = node.parent

    # ---- dropping and eviction -------------------------------------------------------------
    def drop(self, node: Node, tier: str) -> int:
        """Take ``tier`` away from ``node`` and its whole subtree (a store lost a page, say).

        Returns the pages dropped; refuses (ValueError) if the subtree is locked on the tier.
        """
        t = tier_index(tier)
        if node.res[t] is None:
            return 0
        if node.locks[t]:
            raise ValueError(f"cannot drop a node locked on {tier}: {node!r}")
        dropped = 0
        for child in list(node.children.values()):
            dropped += self.drop(child, tier)
        return dropped + self._release(node, t)

    def _release(self, node: Node, t: int) -> int:
        """Unset tier ``t`` of a node without residents below it; free ids; delete if orphaned."""
        value = self._unset(node, t)
        ledger = self.ledgers[t]
        if ledger.allocator is not None and value is not NO_IDS:
            ledger.allocator.free(list(value))
        if not node.anywhere():
            self._delete(node)
        return node.pages

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
            victim = ledger.policy.pop_victim()
            if victim is None:
                raise AssertionError(f"{tier}: policy empty with {ledger.evictable} evictable")
            if use_hook and self.on_evict is not None:
                self.on_evict(victim, tier)
            freed += self._release(victim, t)
        return freed

    def clear(self, tier: str) -> int:
        """Evict every evictable page of ``tier`` (no hooks); locked pages stay."""
        return self.evict(tier, self.ledgers[tier_index(tier)].evictable, use_hook=False)

    # ---- page ids ----------------------------------------------------------------------------
    def can_allocate(self, tier: str, n: int) -> bool:
        ledger = self.ledgers[tier_index(tier)]
        if ledger.allocator is None:
            raise ValueError(f"tier {tier} has no page ids")
        return ledger.allocator.num_free + ledger.evictable >= n

    def allocate(self, tier: str, n: int) -> list[int]:
        """``n`` page ids of ``tier``, evicting as needed; PoolExhausted (nothing evicted) if
        even evicting everything evictable would not make room."""
        ledger = self.ledgers[tier_index(tier)]
        if not self.can_allocate(tier, n):
            raise PoolExhausted(f"{tier}: {n} pages asked, {ledger.allocator.num_free} free, "
                                f"{ledger.evictable} evictable")
        short = n - ledger.allocator.num_free
        if short > 0:
            self.evict(tier, short)
        return ledger.allocator.allocate(n)

    def free(self, tier: str, ids: Sequence[int]) -> None:
        """Return ids the index never took (unused ids of an insert, say) to the tier's pool."""
        ledger = self.ledgers[tier_index(tier)]
        if ids and ledger.allocator is not None:
            ledger.allocator.free(list(ids))

    # ---- inspection ----------------------------------------------------------------------------
    def sizes(self, tier: str) -> TierSizes:
        return self.ledgers[tier_index(tier)].sizes()

    def iter_nodes(self) -> Iterator[Node]:
        """Every non-root node, parents before children."""
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def roots(self) -> dict[bytes, Node]:
        return dict(self._roots)

    def stats(self) -> dict[str, Any]:
        nodes = sum(1 for _ in self.iter_nodes())
        return {"nodes": nodes, "salts": len(self._roots),
                "tiers": {ledger.name: vars(ledger.sizes()) for ledger in self.ledgers}}

    def check_integrity(self, outstanding: Mapping[str, int] | None = None) -> None:
        """Raise AssertionError naming the first broken invariant (see the module docstring).

        ``outstanding`` (tier -> pages) adds a conservation law for pools: pages the allocator
        has handed out = pages the index holds + pages held outside it (jobs, requests).
        """
        check_index(self, outstanding)


class _InsertWalk:
    """One insert's walk down the tree (kept out of RadixIndex to keep functions short)."""

    def __init__(self, index: RadixIndex, data: bytes, keys: Sequence[bytes] | None, t: int,
                 ids: Sequence[int] | None, start: int, stop: int, strict: bool) -> None:
        self.index, self.data, self.keys, self.t = index, data, keys, t
        self.ids, self.start, self.stop, self.strict = ids, start, stop, strict
        self.taken = 0
        self.unused: list[int] = []
        self.pos = 0

    def run(self, root: Node) -> Node | None:
        index, step = self.index, self.index._step
        node, deepest = root, None
        while self.pos < self.stop:
            child = node.children.get(self.data[self.pos * step:(self.pos + 1) * step])
            if child is None:
                return self._grow(node) or deepest
            used = index._common_pages(child, self.data, self.pos, self.stop - self.pos)
            if used < child.pages:
                child = index.split(child, used)
            if not self._cover(node, child):
                return deepest
            for t in range(len(TIERS)):
                index.ledgers[t].policy.touch(child)
            child.last_access = index._clock
            node = deepest = child
            self.pos += used
        return deepest

    def _refuse(self, why: str) -> bool:
        if self.strict:
            raise ValueError(f"insert on {TIERS[self.t]} at page {self.pos}: {why}")
        if self.ids is not None:
            self.unused.extend(self.ids[max(self.pos, self.start) - self.start:])
        return False

    def _grow(self, parent: Node) -> Node | None:
        """Pages from ``pos`` to ``stop`` are new: one node for all of them."""
        if self.pos < self.start:
            self._refuse("pages before the range are not indexed")
            return None
        if not self._parent_ok(parent):
            self._refuse("the parent page is not on the tier")
            return None
        node = self.index._new_node(parent, self.data, self.keys, self.pos, self.stop)
        self.index._set(node, self.t, make_ids(self._ids(self.pos, self.stop)))
        self.taken += self.stop - self.pos
        self.pos = self.stop
        return node

    def _cover(self, parent: Node, node: Node) -> bool:
        """Apply the tier to ``node`` (pages ``[pos, pos + node.pages)``) where in range."""
        lo, hi = max(self.pos, self.start), self.pos + node.pages
        if lo >= hi:
            return True
        value = node.res[self.t]
        if value is not None:  # already held: offered ids that differ are unused
            if value is not NO_IDS and self.ids is not None:
                offered = self._ids(lo, hi)
                held = value[lo - self.pos:]
                self.unused.extend(i for i, h in zip(offered, held, strict=True) if i != h)
            return True
        if lo > self.pos or not self._parent_ok(parent):
            return self._refuse("the parent page is not on the tier")
        self.index._set(node, self.t, make_ids(self._ids(lo, hi)))
        self.taken += hi - lo
        return True

    def _parent_ok(self, parent: Node) -> bool:
        return parent.parent is None or parent.res[self.t] is not None

    def _ids(self, lo: int, hi: int) -> list[int] | None:
        return None if self.ids is None else list(self.ids[lo - self.start:hi - self.start])
