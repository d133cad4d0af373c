"""Work handed to the engine thread from other threads: admin changes and stats snapshots.

Owns ``EngineCalls``: any thread ``submit``s a function and gets a ``concurrent.futures.Future``;
the engine thread runs every pending function between two scheduler steps (``run_pending``),
so a function sees the cache exactly as the engine left it and no request step runs while it
does. The server awaits the future with ``asyncio.wrap_future``. ``close`` fails what is still
pending (the engine stopped). Thread-safe (one lock).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class EngineStopped(RuntimeError):
    """The engine thread is not running, so nothing handed to it will run."""


class EngineCalls:
    """See the module docstring."""

    def __init__(self, wake: Callable[[], None] = lambda: None) -> None:
        self._lock = threading.Lock()
        self._pending: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._closed = False
        self._wake = wake
        self.completed = 0

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Queue ``fn`` for the engine thread; the future holds its result or exception."""
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                future.set_exception(EngineStopped("the engine is not running"))
                return future
            self._pending.append((fn, future))
        self._wake()
        return future

    def waiting(self) -> bool:
        with self._lock:
            return bool(self._pending)

    def run_pending(self) -> int:
        """Engine thread: run every function queued so far; returns how many ran."""
        with self._lock:
            batch, self._pending = self._pending, deque()
        ran = 0
        for fn, future in batch:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller, never kills the engine
                future.set_exception(exc)
            ran += 1
        self.completed += ran
        return ran

    def close(self) -> None:
        """Fail everything pending and refuse new work (the engine thread is ending)."""
        with self._lock:
            self._closed = True
            batch, self._pending = self._pending, deque()
        for _, future in batch:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineStopped("the engine stopped before running this"))
