"""What the engine holds between calls: ``Hit`` (a match), ``Loaded`` (pages pinned on device)
and ``Held`` (pages pinned on host, for an engine that copies them itself).

Owns the handle types ``TieredCache`` returns. The public fields are agreed across ranks
(identical on every rank of a tensor-parallel group); fields starting with ``_`` are this rank's
own view, used by the controller. Engine thread only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.controller.prefetch import PrefetchTask
    from kvtier.index.match import IndexMatch
    from kvtier.index.residency import Node
    from kvtier.transfer.copy_engine import Ticket

TIER_ORDER: tuple[str, ...] = ("device", "host", "disk", "remote")


@dataclass
class Hit:
    """A prompt's cached prefix. ``tokens`` is the usable hit (a multiple of the page size);
    ``tokens_by_tier`` splits it by the fastest tier holding each page, in prefix order
    (device pages first, then host, disk, remote). ``device_page_ids`` are this rank's device
    pages of the device part. ``match`` locks nothing: ``load`` does."""

    tokens: int
    tokens_by_tier: dict[str, int]
    device_page_ids: list[int]
    salt: bytes
    page_size: int
    prompt_tokens: int
    _data: bytes = field(repr=False, default=b"")
    _reach: tuple[int, int, int, int] = (0, 0, 0, 0)       # agreed pages per tier, cumulative
    _store_ends: tuple[int, int] = (0, 0)                   # local: disk end, remote end (pages)
    _prefetch: PrefetchTask | None = field(default=None, repr=False)  # an early prefetch
    #: This rank's walk of the index behind the hit (``IndexMatch``); ``load`` reuses it while
    #: the index has not changed since, so a request walks the tree once.
    _match: IndexMatch | None = field(default=None, repr=False)

    @property
    def pages(self) -> int:
        return self.tokens // self.page_size

    def reach(self, tier: str) -> int:
        """Agreed pages held by ``tier`` or a faster one (cumulative, from the root)."""
        return self._reach[TIER_ORDER.index(tier)]


@dataclass(eq=False)
class Loaded:
    """Pages of a hit now on device and pinned there until ``release``.

    ``tokens`` ends the usable prefix: the engine reuses KV of ``[start_tokens, tokens)`` from
    ``device_page_ids`` (in prefix order, one per page) and computes everything else.
    ``start_tokens`` is 0 unless the engine asked to recompute the head of the hit, in which case
    the pages start where the recompute ends. A multiple of the page size; may be less than
    ``hit.tokens`` after a prefetch timeout, a store miss or a full device pool.
    """

    tokens: int
    device_page_ids: list[int]
    start_tokens: int
    hit: Hit = field(repr=False)
    _lock_node: Node | None = field(default=None, repr=False)
    _private: set[int] = field(default_factory=set, repr=False)
    released: bool = False
    #: The host -> device copy still in flight (``load(..., overlap=True)``), a per-layer
    #: ``kvtier.transfer.copy_engine.Ticket``: consumers wait on it on the device before reading
    #: layer ``l`` (``ticket.stream_wait(layer=l)``); None once the pages have landed.
    ticket: Ticket | None = field(default=None, repr=False)
    _host_lock_node: Node | None = field(default=None, repr=False)
    #: This rank's walk of the index as the load left it; ``commit(..., loaded=...)`` continues
    #: it (``RadixIndex.extend``) instead of walking the tree again.
    _match: IndexMatch | None = field(default=None, repr=False)

    @property
    def pages(self) -> int:
        return len(self.device_page_ids)


@dataclass(eq=False)
class Held:
    """Pages of a hit held on the host tier until ``release``: ``TieredCache.hold_host``'s
    answer, for an engine that copies host pages into its own KV memory itself (no device
    page of kvtier's in between).

    ``host_page_ids[i]`` holds page ``i`` of the prompt; ``tokens`` (a multiple of the page
    size) ends the usable prefix. ``ticket`` is the caller's: a copy still reading the pages
    (anything with ``is_done()`` and ``wait(timeout_s)``), which ``release`` waits for before
    the pages may be evicted or overwritten.
    """

    tokens: int
    host_page_ids: list[int]
    hit: Hit = field(repr=False)
    _host_lock_node: Node | None = field(default=None, repr=False)
    released: bool = False
    ticket: Ticket | None = field(default=None, repr=False)

    @property
    def pages(self) -> int:
        return len(self.host_page_ids)
