"""Pacing for a store guard: retry backoff with jitter, and rate-limited log lines.

Owns ``Backoff`` (delays that double from ``first_s`` up to ``max_s``, each stretched by up to
+-``jitter`` so that many servers that lost the same store do not retry in step) and
``LogLimiter`` (one line per key per ``interval_s``; the next line that passes says how many
were held back meanwhile). Thread-safe (one lock each); used from the guard's thread and from
the IO worker threads that call a guarded store.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable


class Backoff:
    """``next()``: the delay before the next retry; ``reset()`` after a success."""

    def __init__(self, first_s: float, max_s: float, *, jitter: float = 0.2,
                 seed: int | None = None) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError(f"need 0 < first_s <= max_s, got {first_s} and {max_s}")
        if not 0 <= jitter < 1:
            raise ValueError(f"jitter must be within [0, 1), got {jitter}")
        self.first_s, self.max_s, self.jitter = first_s, max_s, jitter
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._failures = 0

    def next(self) -> float:
        with self._lock:
            base = min(self.first_s * 2.0 ** min(self._failures, 62), self.max_s)
            self._failures += 1
            return base * (1.0 + self._rng.uniform(-self.jitter, self.jitter))

    def reset(self) -> None:
        with self._lock:
            self._failures = 0


class LogLimiter:
    """Logs at most one line per key every ``interval_s`` seconds."""

    def __init__(self, logger: logging.Logger, interval_s: float, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[object, tuple[float, int]] = {}  # key -> (logged at, held back since)

    def log(self, level: int, key: object, message: str) -> bool:
        """Log ``message`` unless a line of ``key`` went out less than ``interval_s`` ago;
        True if it was logged."""
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last[0] < self.interval_s:
                self._last[key] = (last[0], last[1] + 1)
                return False
            self._last[key] = (now, 0)
        if last is not None and last[1]:
            message += f" ({last[1]} more like this in the last {now - last[0]:.0f} s)"
        self.logger.log(level, "%s", message)
        return True

    def forget(self, key: object) -> None:
        """The next line of ``key`` goes out at once (its condition ended)."""
        with self._lock:
            self._last.pop(key, None)
