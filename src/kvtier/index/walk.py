"""One walk down the radix tree: following a prompt's pages from a node, and the depths along it.

Owns what every lookup of ``RadixIndex`` is made of: ``descend`` (from a node, as far as the
tree holds the prompt's pages, comparing token bytes), ``common_pages`` (how much of one run
the prompt shares) and ``Depths`` (each tier's depth along the walk, where the walk first leaves
the tier: every tier's resident set is prefix-closed). They read the tree and change nothing.
Engine thread only; no torch.
"""

from __future__ import annotations

from kvtier.index.residency import TIERS, Node

ALL_TIERS = (1 << len(TIERS)) - 1

Path = list[tuple[Node, int]]   # (node, pages of it used), root-down


class Depths:
    """Each tier's depth along a walk as it grows: ``mask`` has bit ``t`` set while tier ``t``
    holds every page walked so far, and ``depth[t]`` is where it stopped holding them."""

    __slots__ = ("depth", "mask")

    def __init__(self) -> None:
        self.depth = [0] * len(TIERS)
        self.mask = ALL_TIERS

    def over(self, path: Path) -> Depths:
        """Account for a path already walked (root-down); returns self."""
        pos = 0
        for node, used in path:
            if node.mask & self.mask != self.mask:
                self.leave(node.mask, pos)
            pos += used
        return self

    def leave(self, node_mask: int, pos: int) -> None:
        mask = self.mask
        for t in range(len(TIERS)):
            if mask >> t & 1 and not node_mask >> t & 1:
                self.depth[t] = pos
        self.mask = mask & node_mask

    def at(self, pages: int) -> tuple[int, ...]:
        """The depths of a walk that matched ``pages`` pages in all."""
        for t in range(len(TIERS)):
            if self.mask >> t & 1:
                self.depth[t] = pages
        return tuple(self.depth)


def descend(node: Node | None, data: bytes, pos: int, path: Path, step: int,
            depths: Depths) -> int:
    """Follow ``data``'s pages (``step`` bytes each) down from ``node``, which ends at page
    ``pos``, as far as the tree holds them, appending each node walked to ``path`` and to
    ``depths``; returns the pages matched in all."""
    full = len(data) // step
    startswith, append, mask = data.startswith, path.append, depths.mask
    while node is not None and pos < full:
        offset = pos * step
        child = node.children.get(data[offset:offset + step])
        if child is None:
            break
        used = child.pages
        if used > full - pos or not startswith(child.tokens, offset):
            used = common_pages(child, data, pos, full - pos, step)
        append((child, used))
        if child.mask & mask != mask:
            depths.leave(child.mask, pos)
            mask = depths.mask
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
