"""The store a guard serves through now, swapped safely under calls in flight.

Owns ``StoreSlot``: ``take`` lends the open store to one call (None while the tier is off) and
``give`` returns it; ``install`` puts a newly opened store in, ``retire`` takes the current one
out, carrying its lifetime counters over (so a tier's counters never go back when its store is
reopened) and closing it once the last call using it has returned. Thread-safe (one lock); the
IO worker threads take and give, the guard's thread installs and retires.
"""

from __future__ import annotations

import logging
import threading

from kvtier.store.base import PageStore, StoreCounters

log = logging.getLogger("kvtier.store")


class Lease:
    """One opened store and the number of calls using it now."""

    __slots__ = ("retired", "store", "users")

    def __init__(self, store: PageStore) -> None:
        self.store, self.users, self.retired = store, 0, False


class StoreSlot:
    """See the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lease: Lease | None = None
        self._retired: list[Lease] = []
        self._closed = False
        self.carried = dict.fromkeys(StoreCounters.NAMES, 0)  # counters of stores retired

    @property
    def current(self) -> PageStore | None:
        """The open store (to read extras from; calls go through ``take``)."""
        lease = self._lease
        return None if lease is None else lease.store

    def take(self) -> Lease | None:
        with self._lock:
            lease = self._lease
            if lease is not None:
                lease.users += 1
            return lease

    def give(self, lease: Lease) -> None:
        with self._lock:
            lease.users -= 1
            done = lease.retired and lease.users == 0
            if done:
                self._retired.remove(lease)
        if done:
            close_quietly(lease.store)

    def install(self, store: PageStore) -> bool:
        """Serve ``store`` from now on; False (and ``store`` closed) once the slot is closed."""
        with self._lock:
            if not self._closed:
                assert self._lease is None, "a store installed over another"
                self._lease = Lease(store)
                return True
        close_quietly(store)
        return False

    def retire(self) -> None:
        """Take the current store out; it is closed once no call uses it."""
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is None:
            return
        try:
            stats = lease.store.stats()
            counters = {name: int(getattr(stats, name)) for name in StoreCounters.NAMES}
        except Exception:
            counters = {}
        with self._lock:
            for name, value in counters.items():
                self.carried[name] += value
            lease.retired = True
            idle = lease.users == 0
            if not idle:
                self._retired.append(lease)
        if idle:
            close_quietly(lease.store)

    def close(self) -> None:
        """Close the current store and every retired one still in use (the cache is closing)."""
        with self._lock:
            self._closed = True
            leases = [lease for lease in (self._lease, *self._retired) if lease is not None]
            self._lease, self._retired = None, []
        for lease in leases:
            close_quietly(lease.store)

    def carried_counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self.carried)


def close_quietly(store: PageStore) -> None:
    try:
        store.close()
    except Exception as exc:
        log.debug("closing a store that was swapped out: %s", exc)
