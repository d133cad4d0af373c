"""The pinned-host-memory ledger.

Owns ``PinnedBudget`` (the process-wide ledger of pinned host bytes: every producer reserves its
bytes, by owner name, before it allocates, and a reservation past the limit is refused with
``PinnedBudgetExceeded`` before anything is allocated) and ``PinnedLease`` (one reservation,
released on close). Buffers are allocated against it by ``kvtier.memory.host_bytes``
(``allocate_host_bytes``, also importable from here). Pure Python, no torch.

Thread-safe: the budget is shared by the engine thread (host pool, read ring at start-up) and IO
worker threads; every method takes one short lock and never blocks on anything else.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvtier.errors import ConfigError, PinnedBudgetExceeded


class PinnedLease:
    """One reservation of ``nbytes`` pinned bytes by ``owner``; ``release()`` gives them back.

    Use it as a context manager or call ``release()``; releasing twice is a no-op.
    """

    __slots__ = ("_budget", "_released", "nbytes", "owner")

    def __init__(self, budget: PinnedBudget, owner: str, nbytes: int) -> None:
        self._budget = budget
        self.owner = owner
        self.nbytes = nbytes
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Give the bytes back to the budget (idempotent)."""
        self._budget._give_back(self)

    def __enter__(self) -> PinnedLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"PinnedLease(owner={self.owner!r}, nbytes={self.nbytes}, {state})"


@dataclass
class _OwnerLedger:
    bytes: int = 0
    leases: int = 0
    peak_bytes: int = 0
    refused: int = 0


class PinnedBudget:
    """The ledger of pinned host bytes in a process, capped at ``limit_bytes``.

    The limit comes from configuration (``host.pinned_budget_bytes``), never from MemTotal.
    """

    def __init__(self, limit_bytes: int) -> None:
        if not isinstance(limit_bytes, int) or isinstance(limit_bytes, bool) or limit_bytes < 0:
            raise ConfigError("host.pinned_budget_bytes", limit_bytes, "an integer >= 0")
        self._limit = limit_bytes
        self._lock = threading.Lock()
        self._held = 0
        self._peak = 0
        self._refused = 0
        self._owners: dict[str, _OwnerLedger] = {}

    @property
    def limit_bytes(self) -> int:
        return self._limit

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._held

    @property
    def available_bytes(self) -> int:
        with self._lock:
            return self._limit - self._held

    def can_reserve(self, nbytes: int) -> bool:
        """Whether a reservation of ``nbytes`` would be granted now."""
        with self._lock:
            return self._held + nbytes <= self._limit

    def reserve(self, owner: str, nbytes: int) -> PinnedLease:
        """Reserve ``nbytes`` for ``owner``; raises ``PinnedBudgetExceeded`` past the limit.

        Call it before allocating: a refusal leaves nothing allocated and nothing held.
        """
        if not isinstance(owner, str) or not owner:
            raise ValueError("a pinned reservation needs a non-empty owner name")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"pinned reservation of {nbytes!r} bytes: need an integer >= 0")
        with self._lock:
            ledger = self._owners.setdefault(owner, _OwnerLedger())
            if self._held + nbytes > self._limit:
                self._refused += 1
                ledger.refused += 1
                raise PinnedBudgetExceeded(owner, nbytes, self._held, self._limit)
            self._held += nbytes
            self._peak = max(self._peak, self._held)
            ledger.bytes += nbytes
            ledger.leases += 1
            ledger.peak_bytes = max(ledger.peak_bytes, ledger.bytes)
        return PinnedLease(self, owner, nbytes)

    def _give_back(self, lease: PinnedLease) -> None:
        with self._lock:
            if lease._released:
                return
            lease._released = True
            self._held -= lease.nbytes
            ledger = self._owners[lease.owner]
            ledger.bytes -= lease.nbytes
            ledger.leases -= 1

    def stats(self) -> dict[str, object]:
        """A snapshot: limit, held, peak, refusals, and bytes/leases/peak/refusals per owner."""
        with self._lock:
            owners = {name: {"bytes": o.bytes, "leases": o.leases, "peak_bytes": o.peak_bytes,
                             "refused": o.refused} for name, o in self._owners.items()}
            return {"limit_bytes": self._limit, "held_bytes": self._held,
                    "available_bytes": self._limit - self._held, "peak_bytes": self._peak,
                    "refused_total": self._refused, "owners": owners}
