"""Write admission: the bound on host pages held by write-through to the stores (staging ring).

Owns ``WriteAdmission``. It never allocates, evicts or writes anything: it is a ledger that says
yes or no, and every outcome is counted. A write-through charge has two phases, keyed by the
store operation (never by an index node, which a split would strand):

1. ``admit(op_id, pages)`` before any host allocation — refusable: past capacity it returns
   False, counts the refusal and changes nothing else.
2. ``occupy(op_id, pages)`` once the pages are resident and the store write is in flight — not
   refusable (the pages already exist); occupying past capacity is counted, not refused.

``release(op_id, reason)`` ends the charge at every exit (store acknowledgement, failure, forced
detach); releasing an unknown or already released operation is a counted no-op, so exits may
overlap safely. ``stale()`` lists charges older than a deadline, so a controller can detach them
instead of letting a leaked charge shrink the ring for ever.

Capacity is the part of the host pool not reserved for prefetch landing
(``staging_capacity_pages``, by default half the pool). Thread-safe: the engine thread admits,
IO workers release on completion; one short lock, nothing blocks. No torch.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from kvtier.errors import ConfigError

RELEASE_REASONS: tuple[str, ...] = ("ack", "failure", "detach")


def staging_capacity_pages(host_pages: int, prefetch_share: float) -> int:
    """Host pages write-through may hold: the complement of the prefetch-landing share."""
    if not 0.0 <= prefetch_share <= 1.0:
        raise ConfigError("host.prefetch_share", prefetch_share, "a value from 0 to 1")
    if host_pages < 0:
        raise ConfigError("host pool pages", host_pages, "an integer >= 0")
    reserved = math.ceil(round(host_pages * prefetch_share, 9))
    return host_pages - reserved


@dataclass
class _Charge:
    pages: int
    occupied: bool
    since: float


class WriteAdmission:
    """Two-phase ledger of staging pages for write-through, capped at ``capacity_pages``."""

    def __init__(self, capacity_pages: int, clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(capacity_pages, int) or isinstance(capacity_pages, bool) \
                or capacity_pages < 0:
            raise ConfigError("staging capacity pages", capacity_pages, "an integer >= 0")
        self.capacity_pages = capacity_pages
        self._clock = clock
        self._lock = threading.Lock()
        self._charges: dict[Hashable, _Charge] = {}
        self._admitted = 0
        self._occupied = 0
        self._peak = 0
        self._counts = {"admitted_total": 0, "refused_total": 0, "refused_pages_total": 0,
                        "occupied_total": 0, "over_capacity_total": 0, "unknown_release_total": 0}
        self._released = dict.fromkeys(RELEASE_REASONS, 0)

    @classmethod
    def for_host_pool(cls, host_pages: int, prefetch_share: float = 0.5) -> WriteAdmission:
        """Capacity from the host pool size and ``host.prefetch_share``."""
        return cls(staging_capacity_pages(host_pages, prefetch_share))

    @property
    def used_pages(self) -> int:
        return self._admitted + self._occupied

    def can_admit(self, pages: int) -> bool:
        return self.used_pages + pages <= self.capacity_pages

    def admit(self, op_id: Hashable, pages: int) -> bool:
        """Phase 1, before host allocation: True and charge ``pages``, or False (counted)."""
        _check_pages(pages)
        with self._lock:
            if op_id in self._charges:
                raise ValueError(f"write operation {op_id!r} is already charged")
            if self._admitted + self._occupied + pages > self.capacity_pages:
                self._counts["refused_total"] += 1
                self._counts["refused_pages_total"] += pages
                return False
            self._charges[op_id] = _Charge(pages, False, self._clock())
            self._admitted += pages
            self._counts["admitted_total"] += 1
            self._note_peak()
            return True

    def occupy(self, op_id: Hashable, pages: int) -> None:
        """Phase 2, pages resident and the store write in flight: never refused.

        Replaces an admitted charge (``pages`` may be fewer than admitted, never a reason to
        refuse); an operation that was not admitted is charged directly and counted if it takes
        the ring past capacity.
        """
        _check_pages(pages)
        with self._lock:
            charge = self._charges.get(op_id)
            if charge is not None and charge.occupied:
                raise ValueError(f"write operation {op_id!r} is already occupying pages")
            if charge is not None:
                self._admitted -= charge.pages
            if self._admitted + self._occupied + pages > self.capacity_pages:
                self._counts["over_capacity_total"] += 1
            since = charge.since if charge is not None else self._clock()
            self._charges[op_id] = _Charge(pages, True, since)
            self._occupied += pages
            self._counts["occupied_total"] += 1
            self._note_peak()

    def release(self, op_id: Hashable, reason: str = "ack") -> int:
        """End ``op_id``'s charge (either phase); returns the pages freed, 0 if none was held."""
        if reason not in RELEASE_REASONS:
            raise ValueError(f"release reason {reason!r}: one of {', '.join(RELEASE_REASONS)}")
        with self._lock:
            charge = self._charges.pop(op_id, None)
            if charge is None:
                self._counts["unknown_release_total"] += 1
                return 0
            if charge.occupied:
                self._occupied -= charge.pages
            else:
                self._admitted -= charge.pages
            self._released[reason] += 1
            return charge.pages

    def detach_all(self) -> int:
        """Release every charge as a forced detach (shutdown, store detached); returns pages."""
        with self._lock:
            ops = list(self._charges)
        return sum(self.release(op, "detach") for op in ops)

    def stale(self, older_than_s: float) -> list[Hashable]:
        """Operations charged for longer than ``older_than_s`` seconds, oldest first."""
        now = self._clock()
        with self._lock:
            old = [(c.since, op) for op, c in self._charges.items() if now - c.since > older_than_s]
        return [op for _, op in sorted(old, key=lambda item: item[0])]

    def charged(self, op_id: Hashable) -> int:
        """Pages ``op_id`` holds now (0 if none)."""
        with self._lock:
            charge = self._charges.get(op_id)
            return 0 if charge is None else charge.pages

    def _note_peak(self) -> None:
        self._peak = max(self._peak, self._admitted + self._occupied)

    def stats(self) -> dict[str, object]:
        with self._lock:
            now = self._clock()
            oldest = min((c.since for c in self._charges.values()), default=None)
            used = self._admitted + self._occupied
            return {"capacity_pages": self.capacity_pages, "admitted_pages": self._admitted,
                    "occupied_pages": self._occupied, "used_pages": used,
                    "free_pages": max(self.capacity_pages - used, 0),
                    "charges": len(self._charges), "peak_used_pages": self._peak,
                    "oldest_charge_age_s": None if oldest is None else now - oldest,
                    **self._counts,
                    **{f"released_{reason}_total": n for reason, n in self._released.items()}}


def _check_pages(pages: int) -> None:
    if not isinstance(pages, int) or isinstance(pages, bool) or pages < 0:
        raise ValueError(f"a write charge needs an integer page count >= 0, got {pages!r}")
