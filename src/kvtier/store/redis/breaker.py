"""A circuit breaker per Redis endpoint, so a dead or stalled server costs ~nothing per call.

Owns ``CircuitBreaker``: after ``failures`` consecutive failed calls it opens for a backoff
(``backoff_s``, doubling after each failed probe up to ``max_backoff_s``, with +-20% seeded
jitter so many clients do not probe in step). While it is not closed, ``allow()`` answers False
at once and the store turns the call into misses or refused writes: callers never probe, so no
call waits on a server that may not answer. The probe is the endpoint's prober thread
(``endpoint``): ``probe_due_in()`` says when, ``begin_probe()`` takes the half-open turn,
and its success closes the breaker while its failure re-opens it for a longer backoff. Pure
Python, thread-safe (one lock); called from the IO worker threads that call the store and from
the prober thread.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass(frozen=True)
class BreakerStats:
    """A snapshot of one breaker."""

    state: str
    consecutive_failures: int
    opened: int        # times the breaker opened
    rejected: int      # calls answered at once because the breaker was open
    backoff_s: float   # the current (or next) open period


class CircuitBreaker:
    """Counts consecutive failures of one endpoint and decides whether a call may try it."""

    def __init__(self, *, failures: int = 3, backoff_s: float = 0.5, max_backoff_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic, seed: int | None = None) -> None:
        if failures < 1:
            raise ValueError(f"failures must be >= 1, got {failures}")
        if backoff_s <= 0 or max_backoff_s < backoff_s:
            raise ValueError("need 0 < backoff_s <= max_backoff_s")
        self._threshold = failures
        self._base_backoff = backoff_s
        self._max_backoff = max_backoff_s
        self._clock = clock
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._state = CLOSED
        self._failures = 0
        self._backoff = backoff_s
        self._retry_at = 0.0
        self._opened = 0
        self._rejected = 0

    def allow(self) -> bool:
        """True if a call may try the endpoint now (it must then report the outcome): only
        while closed. An open or half-open breaker answers False at once."""
        with self._lock:
            if self._state == CLOSED:
                return True
            self._rejected += 1
            return False

    def probe_due_in(self) -> float | None:
        """Seconds until the next probe is due (0: now); None while closed."""
        with self._lock:
            if self._state == CLOSED:
                return None
            return max(0.0, self._retry_at - self._clock())

    def begin_probe(self) -> bool:
        """Take the probe's turn (half-open) if one is due; the prober then reports the
        outcome. A probe that never reports is replaced after one backoff."""
        with self._lock:
            now = self._clock()
            if self._state == CLOSED or now < self._retry_at:
                return False
            self._state = HALF_OPEN
            self._retry_at = now + self._backoff  # lease: another probe only after this
            return True

    def record_success(self) -> None:
        with self._lock:
            self._state = CLOSED
            self._failures = 0
            self._backoff = self._base_backoff

    def record_failure(self) -> bool:
        """Count a failed call; True if this failure opened (or re-opened) the breaker."""
        with self._lock:
            self._failures += 1
            if self._state == HALF_OPEN:
                self._backoff = min(self._backoff * 2, self._max_backoff)
                self._open()
                return True
            if self._state == CLOSED and self._failures >= self._threshold:
                self._open()
                return True
            return False

    def _open(self) -> None:
        self._state = OPEN
        self._opened += 1
        jitter = 1.0 + self._rng.uniform(-0.2, 0.2)
        self._retry_at = self._clock() + self._backoff * jitter

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._state != CLOSED

    def stats(self) -> BreakerStats:
        with self._lock:
            return BreakerStats(self._state, self._failures, self._opened, self._rejected,
                                self._backoff)
