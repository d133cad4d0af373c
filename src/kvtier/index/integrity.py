"""The radix index's conservation laws, checked from scratch (``RadixIndex.check_integrity``).

Owns ``check_index``: one full walk of the tree that recomputes every count the index keeps
incrementally and compares. Tests call it after every step; it costs O(nodes + pages), so
production code does not. Raises ``AssertionError`` (never stripped by ``-O``: no ``assert``
statements) naming the first broken law. It reads the index through its ``Tree`` base (roots,
ledgers, page size), so it does not import ``RadixIndex``. Engine thread; no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NoReturn

from kvtier.index.residency import NO_IDS, TIERS, Node, TierLedger
from kvtier.index.tree import Tree
from kvtier.keys import KEY_BYTES


def _fail(message: str) -> NoReturn:
    raise AssertionError(f"index integrity: {message}")


def check_index(index: Tree, outstanding: Mapping[str, int] | None = None) -> None:
    resident = [0] * len(TIERS)
    protected = [0] * len(TIERS)
    leaves = [0] * len(TIERS)
    seen_ids: list[set[int]] = [set() for _ in TIERS]
    for salt, root in index.roots().items():
        _check_root(root, salt)
        for node in _walk(root):
            _check_node(index, node)
            for t, value in enumerate(node.res):
                if value is None:
                    continue
                resident[t] += node.pages
                if node.locks[t]:
                    protected[t] += node.pages
                elif not node.kids[t]:
                    leaves[t] += 1
                _check_ids(index, node, t, value, seen_ids[t])
    for t, ledger in enumerate(index.ledgers):
        got = (ledger.resident, ledger.protected, len(ledger.policy))
        want = (resident[t], protected[t], leaves[t])
        if got != want:
            _fail(f"{ledger.name}: (resident, protected, policy leaves) kept {got}, counted {want}")
        _check_pool(ledger, resident[t], outstanding)


def _walk(root: Node) -> list[Node]:
    out: list[Node] = []
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def _check_root(root: Node, salt: bytes) -> None:
    if root.parent is not None or root.pages or root.anywhere() or root.salt != salt:
        _fail(f"root of salt {salt!r} is malformed: {root!r}")
    if salt and not root.children:
        _fail(f"empty root kept for salt {salt!r}")


def _check_node(index: Tree, node: Node) -> None:
    step = index.page_size * 4
    parent = node.parent
    if parent is None or parent.children.get(node.tokens[:step]) is not node:
        _fail(f"{node!r} is not its parent's child under its first page")
    if node.pages < 1 or len(node.tokens) != node.pages * step:
        _fail(f"{node!r} holds {len(node.tokens)} token bytes for {node.pages} pages")
    if node.keys and len(node.keys) != node.pages * KEY_BYTES:
        _fail(f"{node!r} holds {len(node.keys)} key bytes for {node.pages} pages")
    if not node.anywhere():
        _fail(f"{node!r} is held by no tier")
    if node.mask != sum(1 << t for t, r in enumerate(node.res) if r is not None):
        _fail(f"{node!r} has residency mask {node.mask:b}")
    if node.salt != parent.salt:
        _fail(f"{node!r} has another salt than its parent")
    below = [0] * len(TIERS)
    kids = [0] * len(TIERS)
    for child in node.children.values():
        for t in range(len(TIERS)):
            below[t] += child.locks[t]
            kids[t] += child.res[t] is not None
    if kids != node.kids:
        _fail(f"{node!r} counts {node.kids} resident children, has {kids}")
    for t in range(len(TIERS)):
        if node.locks[t] < below[t]:
            _fail(f"{node!r} has fewer {TIERS[t]} locks than its children together")
        if node.res[t] is not None and parent.parent is not None and parent.res[t] is None:
            _fail(f"{node!r} is on {TIERS[t]} but its parent is not (prefix closure)")


def _check_ids(index: Tree, node: Node, t: int, value: object, seen: set[int]) -> None:
    ledger = index.ledgers[t]
    if not ledger.has_ids:
        if value is not NO_IDS:
            _fail(f"{node!r} carries ids on {ledger.name}, which has none")
        return
    ids = list(value)  # type: ignore[call-overload]
    if len(ids) != node.pages:
        _fail(f"{node!r} has {len(ids)} {ledger.name} ids for {node.pages} pages")
    is_allocated = getattr(ledger.allocator, "is_allocated", None)
    for page_id in ids:
        if page_id in seen:
            _fail(f"{ledger.name} page id {page_id} is held twice")
        if is_allocated is not None and not is_allocated(page_id):
            _fail(f"{ledger.name} page id {page_id} is held by the index but free in its pool")
        seen.add(page_id)


def _pool_size(allocator: object) -> int | None:
    for name in ("capacity", "num_pages"):
        value = getattr(allocator, name, None)
        if isinstance(value, int):
            return value
    return None


def _check_pool(ledger: TierLedger, resident: int, outstanding: Mapping[str, int] | None) -> None:
    if ledger.allocator is None or outstanding is None:
        return
    size = _pool_size(ledger.allocator)
    if size is None:
        return
    used = size - ledger.allocator.num_free
    held = resident + outstanding.get(ledger.name, 0)
    if used != held:
        _fail(f"{ledger.name}: pool hands out {used} pages, index {resident} + outside "
              f"{outstanding.get(ledger.name, 0)}")
