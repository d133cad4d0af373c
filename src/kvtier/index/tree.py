"""The radix tree's structure: nodes, splits, per-tier residency transitions, path locks.

Owns ``Tree``, the base of ``RadixIndex``: the roots (one per tenant salt), node creation and
splitting, and the only code that changes a node's residency or locks (``_set``, ``_unset``,
``_release``, ``lock``, ``unlock``, ``drop``), each keeping the tier ledgers' resident and
protected counts and the eviction policies' membership exact (see ``kvtier.index.radix`` for
the invariants). ``_set`` and ``_unset`` also tell the optional ``observer`` (KV events); with
none attached that costs one attribute test per transition. Engine thread only; no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

from kvtier.index.eviction import EvictionPolicy, make_eviction_policy
from kvtier.index.residency import (
    NO_IDS,
    TIERS,
    Allocator,
    IdPool,
    Ids,
    Node,
    TierLedger,
    slice_ids,
    tier_index,
)
from kvtier.keys import KEY_BYTES

EvictHook = Callable[[Node, str], None]


class ResidencyObserver(Protocol):
    """Told of every residency change, on the engine thread, after the change (``kvtier.events``).

    ``stored(node, t)``: tier ``t`` now holds ``node``'s run; ``removed(node, t)``: it no longer
    does (``node`` still carries its tokens, keys and parent). ``paused`` true: the index is inside
    ``RadixIndex.clear_tiers``, which reports one ``cleared(index)`` instead of each removal.
    """

    paused: bool

    def stored(self, node: Node, t: int) -> None: ...

    def removed(self, node: Node, t: int) -> None: ...

    def cleared(self, index: Tree) -> None: ...


class Tree:
    """Roots, nodes and residency bookkeeping shared by every index operation."""

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
        #: Bumped by every change of the tree's shape or residency, so that a walk's result can
        #: be reused until the tree changes (``RadixIndex.current``). Locks and hits do not count.
        self.version = 0
        self.on_evict = on_evict
        self.observer: ResidencyObserver | None = None
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

    def _root(self, key: bytes) -> Node:
        root = self._roots.get(key)
        if root is None:
            root = self._roots[key] = Node(None, b"", b"", 0, key)
        return root

    def _new_node(self, parent: Node, data: bytes, keys: Sequence[bytes] | None, lo: int,
                  hi: int) -> Node:
        self.version += 1
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
        self.version += 1
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

    # ---- residency transitions (keep counts and policy membership exact) -----------------
    def _set(self, node: Node, t: int, value: Ids) -> None:
        self.version += 1
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
        if self.observer is not None:
            self.observer.stored(node, t)

    def _unset(self, node: Node, t: int) -> Ids | None:
        self.version += 1
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
        if self.observer is not None and not self.observer.paused:
            self.observer.removed(node, t)
        return value

    def _delete(self, node: Node) -> None:
        """Remove a node held nowhere (and therefore without children) from the tree."""
        self.version += 1
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
        assert value is not None, f"{node!r} released from tier {t} that does not hold it"
        ledger = self.ledgers[t]
        if ledger.allocator is not None and value is not NO_IDS:
            ledger.allocator.free(list(value))
        if not node.anywhere():
            self._delete(node)
        return node.pages

    def iter_nodes(self) -> Iterator[Node]:
        """Every non-root node, parents before children."""
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def roots(self) -> dict[bytes, Node]:
        return dict(self._roots)
