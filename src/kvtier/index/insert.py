"""One insert's walk down the radix tree (``RadixIndex.insert``), and the checks of its range.

Owns ``InsertWalk``: it follows the prompt's pages from the root (or along a walk already made,
node by node), splits runs where the prompt departs from them or where the range ends, puts the
tier on every node of the range that lacks it (closure permitting), grows one new node for the
pages the tree lacks, collects the ids it did not take, and records the path it walked. It works
on the index's ``Tree`` base (splits, residency, ledgers), never on ``RadixIndex`` itself, so the
index imports the walk and not the other way round. Engine thread only; no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.index.residency import NO_IDS, TIERS, Node, TierLedger, make_ids
from kvtier.index.tree import Tree
from kvtier.index.walk import common_pages


class InsertWalk:
    """One insert's walk down the tree (kept out of RadixIndex to keep functions short)."""

    def __init__(self, index: Tree, data: bytes, keys: Sequence[bytes] | None, t: int,
                 ids: Sequence[int] | None, start: int, stop: int, strict: bool) -> None:
        self.index, self.data, self.keys, self.t = index, data, keys, t
        self.ids, self.start, self.stop, self.strict = ids, start, stop, strict
        self.taken = 0
        self.unused: list[int] = []
        self.pos = 0
        #: The nodes walked, root-down, each (node, pages used), and the node ending at ``pos``.
        self.path: list[tuple[Node, int]] = []
        self.at: Node | None = None

    def run(self, root: Node, along: Sequence[tuple[Node, int]] = ()) -> Node | None:
        """Walk and apply the range; ``along`` (a current walk of these tokens) is followed
        node by node while it covers whole nodes, instead of looking up and comparing."""
        index = self.index
        node, deepest = root, None
        self.at = root
        hints = iter(along)
        while self.pos < self.stop:
            child, used = self._next(node, next(hints, None))
            if child is None:
                return self._grow(node) or deepest
            if used < child.pages:
                child = index.split(child, used)
            if not self._cover(node, child):
                return deepest
            for t in range(len(TIERS)):
                index.ledgers[t].policy.touch(child)
            child.last_access = index._clock
            self.path.append((child, used))
            node = deepest = self.at = child
            self.pos += used
        return deepest

    def _next(self, node: Node, hint: tuple[Node, int] | None) -> tuple[Node | None, int]:
        """The child of ``node`` holding page ``pos`` and how many of its pages the range
        uses: the followed walk's next node when that walk used all of it, else looked up."""
        if hint is not None and hint[1] == hint[0].pages and hint[0].parent is node:
            return hint[0], min(hint[1], self.stop - self.pos)
        step = self.index._step
        child = node.children.get(self.data[self.pos * step:(self.pos + 1) * step])
        if child is None:
            return None, 0
        return child, common_pages(child, self.data, self.pos, self.stop - self.pos, step)

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
        self.path.append((node, self.stop - self.pos))
        self.pos = self.stop
        self.at = node
        return node

    def _cover(self, parent: Node, node: Node) -> bool:
        """Apply the tier to ``node`` (pages ``[pos, pos + node.pages)``) where in range."""
        lo, hi = max(self.pos, self.start), self.pos + node.pages
        if lo >= hi:
            return True
        value = node.res[self.t]
        if value is not None:  # already held: offered ids that differ are unused
            if value is not NO_IDS and self.ids is not None:
                offered = self._ids(lo, hi) or []
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


def check_insert_args(ledger: TierLedger, full: int, keys: Sequence[bytes] | None,
                      ids: Sequence[int] | None, start: int, stop: int) -> None:
    """Refuse (``ValueError``) an insert of pages ``[start, stop)`` of a prompt of ``full``
    pages whose ids or keys do not fit the range or the tier."""
    if not 0 <= start <= stop <= full:
        raise ValueError(f"page range [{start}, {stop}) outside the prompt's {full} full pages")
    if ledger.has_ids != (ids is not None):
        need = "needs page ids" if ledger.has_ids else "takes no page ids"
        raise ValueError(f"tier {ledger.name} {need}")
    if ids is not None and len(ids) != stop - start:
        raise ValueError(f"{len(ids)} ids for {stop - start} pages")
    if keys is not None and len(keys) < stop:
        raise ValueError(f"{len(keys)} keys for {stop} pages")
