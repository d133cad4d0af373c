"""Fail-open store tiers: the ``PageStore`` a cache holds for each store it opens from config.

Owns ``StoreGuard``. A store is an accelerator, so a broken one must never stop an engine from
starting or a request from completing: the guard starts *off* when its store cannot be opened
(instead of failing the start), answers every call at once while off (misses, refused writes,
counted), and its ``supervisor`` reopens the store in the background with backoff, probes it
while open, and says when it is *degraded* (full, failing, unreachable, removed) — a
rate-limited log line, a count per reason, and ``health()`` for ``/health`` and metrics.
``epoch`` grows whenever the pages the store held may be gone (the controller then drops what
its index believed the tier holds). Settings wrong in themselves (``ConfigError``) still fail
``open``.

Calls go through a ``lease.StoreSlot``, so a store swapped out (removed directory, reopen) is
closed only once the last call on it returned; a backend that raises ``OSError`` for an outage
(breaking the store contract) is answered as failed pages, counted. Optional extras of the
backend (``resize``, ``clear``, ``disk_usage``, ``server_info``) are reached through the guard
while a store is open.

Threads: IO worker threads call it like any store; the supervisor's daemon thread probes and
reopens; ``health``, ``stats`` and ``available`` from any thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from kvtier.layout import ByteRange
from kvtier.store.base import Buffer, PageStore, StoreCounters, StoreStats
from kvtier.store.lease import StoreSlot
from kvtier.store.supervisor import GuardSettings, Opener, Supervisor

R = TypeVar("R")

#: Extras of a backend reached through the guard while a store is open (admin, tools).
FORWARDED = frozenset({"resize", "clear", "disk_usage", "server_info", "breaker_states",
                       "root", "options", "layout"})

__all__ = ["GuardSettings", "Opener", "StoreGuard"]


class StoreGuard(PageStore):
    """See the module docstring. Build with ``StoreGuard.open``."""

    def __init__(self, tier: str, opener: Opener, *, page_bytes: int, scheme: str, url: str,
                 settings: GuardSettings | None = None, seed: int | None = None) -> None:
        super().__init__(page_bytes)
        self.tier, self.scheme, self.url = tier, scheme, url
        self.slot = StoreSlot()
        self._own = StoreCounters()  # pages answered while off, or after a store raised
        self.supervisor = Supervisor(tier, url, opener, self.slot, self._counters,
                                     settings or GuardSettings(), seed)

    @classmethod
    def open(cls, tier: str, opener: Opener, **kwargs: Any) -> StoreGuard:
        """A guard over ``opener()``, opened now: off (and retried) when that fails, except for
        ``ConfigError``, which is raised."""
        guard = cls(tier, opener, **kwargs)
        guard.supervisor.open_now()
        return guard

    # ---- the store contract ----------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self._check_open()
        return self._call("contains", len(keys), lambda s: s.contains(keys), _misses(keys))

    def read_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        self._check_batch(keys, buffers)
        return self._call("read", len(keys), lambda s: s.read_into(keys, buffers), _misses(keys))

    def read_ranges_into(self, keys: Sequence[bytes], ranges: Sequence[ByteRange],
                         buffers: Sequence[Buffer]) -> list[bool]:
        self._check_batch(keys, buffers)
        return self._call("read", len(keys), lambda s: s.read_ranges_into(keys, ranges, buffers),
                          _misses(keys))

    def write(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        self._check_batch(keys, buffers)
        return self._call("write", len(keys), lambda s: s.write(keys, buffers), _misses(keys))

    def delete(self, keys: Sequence[bytes]) -> int:
        self._check_open()
        return self._call("delete", len(keys), lambda s: s.delete(keys), lambda: 0)

    def _call(self, op: str, n: int, fn: Callable[[PageStore], R], fallback: Callable[[], R]) -> R:
        """``fn`` on the open store; ``fallback()`` while off, or when the store raised for an
        outage, the pages counted as failed."""
        lease = self.slot.take()
        if lease is None:
            self._own.add(**_failed_pages(op, n, error=False))
            return fallback()
        try:
            return fn(lease.store)
        except OSError as exc:
            self._own.add(**_failed_pages(op, n, error=True))
            self.supervisor.logs.log(logging.WARNING, ("raised", op), f"{self.tier} tier "
                                     f"({self.url}): a {op} raised {type(exc).__name__}: {exc}; "
                                     "counted as failed pages")
            return fallback()
        finally:
            self.slot.give(lease)

    def stats(self) -> StoreStats:
        """The open store's snapshot plus what stores swapped out and the guard itself counted
        (while off: only those)."""
        base = StoreStats(backend=self.scheme)
        lease = self.slot.take()
        if lease is not None:
            try:
                base = lease.store.stats()
            except Exception:  # a store that cannot count now reads as it was
                pass
            finally:
                self.slot.give(lease)
        extra = self._extra_counters()
        return replace(base, **{k: getattr(base, k) + v for k, v in extra.items()})

    def _extra_counters(self) -> dict[str, int]:
        own, carried = self._own.snapshot(), self.slot.carried_counters()
        return {k: own[k] + carried[k] for k in StoreCounters.NAMES}

    def _counters(self) -> dict[str, int]:
        stats = self.stats().as_dict()
        return {k: int(v) for k, v in stats.items() if k in StoreCounters.NAMES and
                isinstance(v, int)}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.supervisor.stop()
        self.slot.close()

    # ---- what the cache and the server read ----------------------------------------------------
    @property
    def available(self) -> bool:
        return self.slot.current is not None

    @property
    def epoch(self) -> int:
        return self.supervisor.epoch

    def health(self) -> dict[str, object]:
        return {"backend": self.scheme, "url": self.url, **self.supervisor.health()}

    def __getattr__(self, name: str) -> Any:
        if name in FORWARDED and "slot" in self.__dict__:
            store = self.__dict__["slot"].current
            if store is not None:
                return getattr(store, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r} now")


def _failed_pages(op: str, n: int, *, error: bool) -> dict[str, int]:
    """Counters of ``n`` pages a call could not serve (``error``: an outage caused it)."""
    errors = n if error else 0
    if op == "read":
        return {"misses": n, "errors": errors}
    if op == "write":
        return {"refused": n, "errors": errors}
    return {"errors": errors}


def _misses(keys: Sequence[bytes]) -> Callable[[], list[bool]]:
    return lambda: [False] * len(keys)
