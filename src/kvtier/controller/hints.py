"""Cache hints honoured softly and within bounds: ``HintBook``.

Owns the step from a request's ``CacheHint`` (``kvtier.hints``) to the eviction order of the
tiers whose policy ``supports_boost``. A hint's retention becomes a *head start*: the prefix is
ranked as if used ``retention_s x fill rate`` pages of new content later (the fill rate is the
tier's measured rate of new pages per second), so under the current load it outlives about
``retention_s`` of traffic, and under a heavier load, less: it decays with the new content that
arrives, and it is never a pin. When ``retention_s`` has passed (the caller's clock), the head
start is cleared.

Bounds: one tenant's hinted pages may not exceed ``share`` of the device tier; a hint beyond
that is honoured for the prefix pages that fit and the rest is refused and counted. Counters
(``hint_*``) go to the controller's counters, so they reach ``stats()`` and the metrics.
Engine thread only (the replay's main thread in a replay); time is passed in, never read here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.hints import CacheHint
from kvtier.index.residency import TIER_INDEX, Node
from kvtier.index.tree import Tree

FILL_WINDOW_S = 60.0   # the fill rate is re-measured over this much time


@dataclass(frozen=True)
class HintOutcome:
    """What became of one request's hint (shown to the caller in ``usage.kvtier``)."""

    retention_s: float
    applied_pages: int
    refused_pages: int
    head_start_pages: float

    def as_dict(self) -> dict[str, object]:
        return {"retention_s": self.retention_s, "applied_pages": self.applied_pages,
                "refused_pages": self.refused_pages,
                "head_start_pages": round(self.head_start_pages, 1)}


class HintBook:
    """Per-tenant hinted prefixes, their expiry, and the fill rate that sizes head starts."""

    def __init__(self, index: Tree, share: float, count: Callable[[str, int], None],
                 tiers: Sequence[str] = ("device", "host")) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"hint share must be within [0, 1], got {share}")
        self.index = index
        self.share = share
        self.count = count
        self.ledgers = [index.ledgers[TIER_INDEX[t]] for t in tiers
                        if index.ledgers[TIER_INDEX[t]].policy.supports_boost]
        #: tenant -> node -> (expiry, pages), oldest hint first
        self._hinted: dict[bytes, OrderedDict[Node, tuple[float, int]]] = {}
        self._fill = (0.0, 0, 0.0)          # window start, pages since, last measured rate
        self._started = False

    @property
    def active(self) -> bool:
        return self.share > 0.0 and bool(self.ledgers)

    def observe(self, new_pages: int, now: float) -> None:
        """``new_pages`` pages were born at ``now`` (feeds the fill rate)."""
        start, pages, rate = self._fill
        if not self._started:
            self._fill, self._started = (now, new_pages, 0.0), True
            return
        pages += new_pages
        if now - start >= FILL_WINDOW_S:
            self._fill = (now, 0, pages / (now - start))
        else:
            self._fill = (start, pages, rate)

    @property
    def fill_rate(self) -> float:
        """New pages per second, over the last full window (0 until one has passed)."""
        return self._fill[2]

    def apply(self, path: Sequence[Node], hint: CacheHint, tenant: bytes,
              now: float) -> HintOutcome:
        """Give the prefix ``path`` (root first) the hint's head start, within the tenant's
        share."""
        self.count("hint_requests_total", 1)
        if not self.active:
            self.count("hint_ignored_total", 1)
            return HintOutcome(hint.retention_s, 0, 0, 0.0)
        self.expire(now)
        book = self._hinted.setdefault(tenant, OrderedDict())
        room = int(self.share * self._device_pages()) - self._used(book)
        head = hint.retention_s * self.fill_rate
        applied = refused = 0
        for node in path:
            if node in book:
                book.move_to_end(node)
            elif node.pages > room:
                refused += node.pages
                continue
            else:
                room -= node.pages
            book[node] = (now + hint.retention_s, node.pages)
            applied += node.pages
            self._boost(node, head)
        self.count("hint_pages_applied_total", applied)
        self.count("hint_pages_refused_total", refused)
        return HintOutcome(hint.retention_s, applied, refused, head)

    def expire(self, now: float) -> None:
        """Clear the head start of every hint whose retention has passed."""
        for book in self._hinted.values():
            stale = [n for n, (expiry, _) in book.items() if expiry <= now]
            for node in stale:
                del book[node]
                self._boost(node, 0.0)
            if stale:
                self.count("hint_pages_expired_total", sum(n.pages for n in stale))

    def hinted_pages(self) -> int:
        return sum(self._used(book) for book in self._hinted.values())

    def _device_pages(self) -> int:
        ledger = self.index.ledgers[TIER_INDEX["device"]]
        if ledger.capacity is not None:
            return int(ledger.capacity)
        return int(ledger.resident + (ledger.free_pages() or 0))

    def _used(self, book: OrderedDict[Node, tuple[float, int]]) -> int:
        """Hinted pages still held on the device (evicted ones stop counting)."""
        device = TIER_INDEX["device"]
        return sum(pages for node, (_, pages) in book.items() if node.res[device] is not None)

    def _boost(self, node: Node, pages: float) -> None:
        for ledger in self.ledgers:
            ledger.policy.boost(node, pages)
