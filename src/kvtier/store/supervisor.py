"""The thread that keeps one store tier open: opens, probes, judges, reopens with backoff.

Owns ``Supervisor``, the state behind a ``StoreGuard``: whether the tier is off (and why, and
when it is tried again), its active problems (``conditions``), its ``epoch`` (grows whenever the
pages the store held may be gone) and event counts. ``open_now`` is the first open, on the
caller's thread; afterwards its daemon thread (``kvtier-guard-<tier>``) wakes every
``check_interval_s`` while the store is open, probes it and judges its counters, and while it is
off wakes when the backoff says and opens it again. What an open does with each failure:

- ``StoreCorrupt`` (a lost or garbled manifest, a garbage journal head): the directory is moved
  aside (``quarantine.set_aside``, never deleted) and the open is tried again at once;
- ``LayoutMismatch`` (another page size: another model's store): left untouched, the tier off;
- ``ConfigError``: raised by the first open (settings wrong in themselves); later, off;
- anything else (unreachable, permissions, IO): off, retried.

Every transition is logged (ERROR when the tier goes off, WARNING for problems and returns, at
most one line per reason per ``log_interval_s``). ``health`` from any thread; one lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.errors import ConfigError, LayoutMismatch, StoreCorrupt
from kvtier.store.base import PageStore, Probe
from kvtier.store.conditions import Conditions, Problem
from kvtier.store.lease import StoreSlot
from kvtier.store.pacing import Backoff, LogLimiter
from kvtier.store.quarantine import set_aside

log = logging.getLogger("kvtier.store")
Opener = Callable[[], PageStore]


@dataclass(frozen=True)
class GuardSettings:
    """Pacing of a guard (the README's "When a store fails" says why these values)."""

    check_interval_s: float = 2.0   # probe and counter check of an open store
    retry_first_s: float = 1.0      # first reopen of a store that is off; doubles per failure
    retry_max_s: float = 30.0       # the cap of that backoff
    log_interval_s: float = 60.0    # at most one line per tier and reason this often


class Supervisor:
    """See the module docstring."""

    def __init__(self, tier: str, url: str, opener: Opener, slot: StoreSlot,
                 counters: Callable[[], dict[str, int]], settings: GuardSettings,
                 seed: int | None = None) -> None:
        self.tier, self.url, self.settings = tier, url, settings
        self._opener, self._slot, self._counters = opener, slot, counters
        self._lock = threading.Lock()
        self._ticking = threading.Lock()  # one tick at a time (the thread, or a caller's)
        self._conditions = Conditions()
        self._off: Problem | None = None
        self._retry_at: float | None = None
        self._backoff = Backoff(settings.retry_first_s, settings.retry_max_s, seed=seed)
        self.logs = LogLimiter(log, settings.log_interval_s)
        self.epoch = 0
        self.events: Counter[str] = Counter()  # opened, open_failed, set_aside, lost
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def open_now(self) -> None:
        """The first open, then the thread starts; raises ``ConfigError`` only."""
        with self._ticking:
            self._open(first=True)
        self._thread = threading.Thread(target=self._run, name=f"kvtier-guard-{self.tier}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10.0)  # an open in flight ends within the store's own timeout

    def health(self) -> dict[str, object]:
        now = time.monotonic()
        with self._lock:
            active = list(self._conditions.active.values())
            if self._off is not None:
                active.insert(0, self._off)
            off = self._slot.current is None
            return {
                "state": "off" if off else "degraded" if active else "on",
                "problems": {p.reason: {"message": p.message, "for_s": round(now - p.since, 1)}
                             for p in active},
                "retry_in_s": None if self._retry_at is None or not off else
                round(max(0.0, self._retry_at - now), 1),
                "epoch": self.epoch, "events_total": dict(self.events),
                "problems_total": dict(self._conditions.seen_total)}

    # ---- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                wait = self.settings.check_interval_s
                if self._slot.current is None and self._retry_at is not None:
                    wait = max(0.0, self._retry_at - time.monotonic())
            if self._stop.wait(wait):
                return
            try:
                self.tick()
            except Exception as exc:  # never dies: the next tick tries again
                self.logs.log(logging.ERROR, "tick", f"{self.tier} tier: store check failed: "
                              f"{type(exc).__name__}: {exc}")

    def tick(self, *, reopen_now: bool = False) -> None:
        """One check: reopen a store that is off and due (``reopen_now``: due or not), else
        probe and judge the open one."""
        with self._ticking:
            self._tick(reopen_now)

    def _tick(self, reopen_now: bool) -> None:
        lease = self._slot.take()
        if lease is None:
            if reopen_now or (self._retry_at is not None and time.monotonic() >= self._retry_at):
                self._open()
            return
        try:
            probe = _probe(lease.store)
        finally:
            self._slot.give(lease)
        if probe.reopen:
            self._lose(probe)
            self._open()
            return
        if probe.lost:
            with self._lock:
                self.epoch += 1
                self.events["lost"] += 1
            self.logs.log(logging.WARNING, "lost", f"{self.tier} tier ({self.url}): the store "
                          "lost the pages it held (a restart or a flush); kvtier forgets them "
                          "and writes them again")
        counters = self._counters()
        with self._lock:
            fresh, ended = self._conditions.observe(probe, counters, time.monotonic(),
                                                    self.settings.check_interval_s)
        for problem in fresh:
            self.logs.log(logging.WARNING, problem.reason, f"{self.tier} tier ({self.url}) "
                          f"degraded: {problem.message}")
        for problem in ended:
            self.logs.forget(problem.reason)
            self.logs.log(logging.WARNING, ("over", problem.reason), f"{self.tier} tier "
                          f"({self.url}): {problem.reason.replace('_', ' ')} over")

    # ---- transitions -------------------------------------------------------------------------
    def _lose(self, probe: Probe) -> None:
        self._slot.retire()
        with self._lock:
            self.epoch += 1
            self.events["lost"] += 1
            self._conditions.clear()
            self._conditions.seen_total[probe.reason or "gone"] += 1
        log.error("%s tier (%s): %s; opening it again", self.tier, self.url, probe.problem)

    def _open(self, *, first: bool = False) -> None:
        for attempt in range(2):
            try:
                store = self._opener()
            except ConfigError as exc:
                if first:
                    raise
                self._failed("config", str(exc), first)
            except StoreCorrupt as exc:
                if attempt == 0 and exc.location is not None and self._set_aside(exc):
                    continue
                self._failed("corrupt", str(exc), first)
            except LayoutMismatch as exc:
                self._failed("foreign", str(exc), first)
            except Exception as exc:
                text = str(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
                self._failed("unavailable", text, first)
            else:
                self._opened(store, first)
            return

    def _set_aside(self, exc: StoreCorrupt) -> bool:
        """Move the damaged directory aside; True when the open should be tried again."""
        assert exc.location is not None
        try:
            moved = set_aside(exc.location)
        except OSError as err:
            log.error("%s tier: %s; cannot move it aside: %s", self.tier, exc, err)
            return False
        if moved is not None:
            with self._lock:
                self.events["set_aside"] += 1
                self._conditions.seen_total["corrupt"] += 1
            log.error("%s tier: %s; moved it aside to %s (kept for inspection: delete it when "
                      "done) and opened an empty store in its place", self.tier, exc, moved)
        return True

    def _failed(self, reason: str, message: str, first: bool) -> None:
        now = time.monotonic()
        delay = self._backoff.next()
        with self._lock:
            was_off = self._off is not None
            self._off = Problem(reason, message, self._off.since if self._off else now, now)
            self._retry_at = now + delay
            self.events["open_failed"] += 1
            self._conditions.seen_total[reason] += 1
        if not was_off:
            self.logs.forget("off")
        self.logs.log(logging.WARNING if was_off and not first else logging.ERROR, "off",
                      f"{self.tier} tier ({self.url}) is off, kvtier serves without it: "
                      f"{message}; retrying in {delay:.0f} s")

    def _opened(self, store: PageStore, first: bool) -> None:
        if not self._slot.install(store):
            return
        with self._lock:
            was_off, self._off, self._retry_at = self._off is not None, None, None
            self.epoch += 0 if first else 1
            self.events["opened"] += 1
        self._backoff.reset()
        if was_off:
            self.logs.forget("off")
            log.warning("%s tier (%s) is back on", self.tier, self.url)


def _probe(store: PageStore) -> Probe:
    try:
        return store.probe()
    except Exception as exc:
        return Probe(f"its health check failed: {type(exc).__name__}: {exc}", "io_errors")
