"""Pages of a ``file://`` store that failed verification: dropped everywhere, their bytes freed.

Owns ``DamagedPages``. A record the index names but that reads back torn (the file ends inside
it), corrupt (a checksum, a header field, another key) or gone (its segment file was removed)
is never served; left in the index it would also be promised again by every ``contains``, so
the cache would neither serve it nor store a good copy over it, and a restart would bring it
back from the journal. After a read that rejected records, ``drop`` journals a delete of each
one (every process sharing the directory forgets it, and so does the next opening), but only
while the index still maps the key to the very record that failed (a good copy another writer
stored meanwhile stays). A segment left without live pages is evicted at once (its bytes
return); a damaged record in a segment that still holds live pages is dead space until FIFO
eviction takes that segment (segments are never rewritten in place). Dropped pages are counted
(``dropped``) and logged.

When the read that found them also had IO errors, each rejected record is read once more on its
own: only one that reads torn or corrupt again is dropped (an IO error is an outage, not damage).

Runs on the IO worker thread whose read found the damage.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvtier.store.file.handle import StoreHandle
from kvtier.store.file.index import SLOT_BITS, SLOT_MASK
from kvtier.store.file.journal import OP_DELETE, Entry
from kvtier.store.record import Verdict

log = logging.getLogger(__name__)


class DamagedPages:
    """Drops the records one ``FileStore`` handle found damaged (see the module docstring)."""

    def __init__(self, store: StoreHandle) -> None:
        self.store = store

    def drop(self, keys: Sequence[bytes], locs: Sequence[int | None], found: Sequence[bool],
             io_errors: int) -> int:
        """After a read of ``keys`` (``locs``: the records it read, None: not in the index;
        ``found``: what it served; ``io_errors``: how many failed with an IO error), drop the
        records it rejected for damage. Returns the pages dropped."""
        suspects = [(bytes(keys[i]), loc) for i, loc in enumerate(locs)
                    if loc is not None and not found[i]]
        if not suspects:
            return 0
        bad = suspects if io_errors == 0 else [s for s in suspects if self._damaged(*s)]
        if not bad:
            return 0
        dropped = self._forget(bad)
        if not dropped:
            return 0
        freed = self._free_empty_segments({loc >> SLOT_BITS for _, loc in bad})
        self.store.counters.add(dropped=dropped)
        log.warning("file store %s: dropped %d pages that failed verification (torn, corrupt or "
                    "gone); the next write stores them again; %d segments without live pages "
                    "freed", self.store.root, dropped, freed)
        return dropped

    def _damaged(self, key: bytes, loc: int) -> bool:
        """Whether the record at ``loc`` reads damaged again (an IO error: not known)."""
        store, seg = self.store, loc >> SLOT_BITS
        fd = store.readers.pin(seg)
        if fd is None:
            return True  # the segment file is gone
        try:
            page = memoryview(bytearray(store.page_bytes))
            return store.io.read(fd, loc & SLOT_MASK, key, page) is not Verdict.OK
        except OSError:
            return False
        finally:
            store.readers.unpin(seg)

    def _forget(self, bad: list[tuple[bytes, int]]) -> int:
        """Journal a delete of each key still mapped to its damaged record; returns how many."""
        store = self.store
        taken: list[Entry] = []

        def entries() -> list[Entry]:  # asked once caught up, under the journal lock
            where = store.index.where
            taken[:] = [Entry(OP_DELETE, key=key) for key, loc in bad if where.get(key) == loc]
            return list(taken)

        try:
            store.publish(entries)
        except OSError as exc:  # the journal cannot take it: this handle forgets them anyway
            store.counters.add(errors=1)
            log.warning("file store %s: cannot journal the drop of damaged pages (%s); only "
                        "this process forgets them", store.root, exc)
            with store.index_lock:
                where = store.index.where
                taken[:] = [Entry(OP_DELETE, key=key) for key, loc in bad if where.get(key) == loc]
                for entry in taken:
                    store.index.apply(entry)
        return len(taken)

    def _free_empty_segments(self, segs: set[int]) -> int:
        """Evict the segments in ``segs`` that hold no live page now (none a writer holds)."""
        store = self.store
        with store.index_lock:
            empty = sorted(seg for seg in segs if not store.index.live_keys(seg))
        if not empty:
            return 0
        before = set(empty)
        store.evictor.evict(lambda: True, reinsert=False, candidates=empty)
        with store.index_lock:
            return len(before - set(store.index.seg_slots))
