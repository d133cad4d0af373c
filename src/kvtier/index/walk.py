"""One walk down the radix tree: following a prompt's pages from a node, and the depths along it.

Owns the pure functions every lookup of ``RadixIndex`` is made of: ``descend`` (from a node, as
far as the tree holds the prompt's pages, comparing token bytes), ``common_pages`` (how much of
one run the prompt shares) and ``depths`` (each tier's depth along a walked path, where the path
first leaves the tier: every tier's resident set is prefix-closed). They read the tree and
change nothing. Engine thread only; no torch.
"""

from __future__ import annotations

from kvtier.index.residency import TIERS, Node

ALL_TIERS = (1 << len(TIERS)) - 1

Path = list[tuple[Node, int]]   # (node, pages of it used), root-down


def descend(node: Node | None, data: bytes, pos: int, path: Path, step: int) -> int:
    """Follow ``data``'s pages (``step`` bytes each) down from ``node``, which ends at page
    ``pos``, as far as the tree holds them, appending each node walked to ``path``; returns the
    pages matched in all."""
    full = len(data) // step
    startswith, append = data.startswith, path.append
    while node is not None and pos < full:
        offset = pos * step
        child = node.children.get(data[offset:offset + step])
        if child is None:
            break
        used = child.pages
        if used > full - pos or not startswith(child.tokens, offset):
            used = common_pages(child, data, pos, full - pos, step)
        append((child, used))
        pos += used
        node = child if used == child.pages else None
    return pos


def common_pages(node: Node, data: bytes, pos: int, limit: int, step: int) -> int:
    """Leading pages of ``node`` (at most ``limit``) equal to ``data``'s pages from ``pos``;
    its first page is known to be equal (the tree found it by that page)."""
    n = min(node.pages, limit)
    if data.startswith(node.tokens if n == node.pages else node.tokens[:n * step], pos * step):
        return n
    used = 1
    while used < n and data.startswith(node.tokens[used * step:(used + 1) * step],
                                       (pos + used) * step):
        used += 1
    return used


def depths(path: Path, pages: int) -> tuple[int, ...]:
    """Per tier (``TIERS`` order), the pages from the root that the tier holds along ``path``
    (a walk that matched ``pages`` pages)."""
    depth = [0] * len(TIERS)
    mask, pos = ALL_TIERS, 0  # tiers holding every page walked so far
    for node, used in path:
        if node.mask & mask != mask:
            for t in range(len(TIERS)):
                if mask >> t & 1 and not node.mask >> t & 1:
                    depth[t] = pos
            mask &= node.mask
        pos += used
    for t in range(len(TIERS)):
        if mask >> t & 1:
            depth[t] = pages
    return tuple(depth)
