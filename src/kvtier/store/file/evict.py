"""Capacity of the ``file://`` store: FIFO eviction of whole segments, with reinsertion.

Owns ``Evictor``. When a write would take segment bytes past ``max_bytes``, or the filesystem's
free space below ``min_free_bytes``, the oldest segments go first; live pages in a victim that
were read since they were written are copied forward into the writer's current segment (at most
half a segment's worth, so eviction always makes progress), the rest are dropped. The victim
file is unlinked, then it leaves every index through an evict entry in the journal: a reader
anywhere that already holds the file open keeps reading intact bytes (the space returns when the
last descriptor closes; processes close theirs on their next call), and segments that a live
process still appends to (held with ``flock``) are never victims. One process evicts at a time
(``evict.lock``). Also cleans crash leftovers at open. Runs on the IO worker thread whose write
needed room, or on the thread that opened the store.

Why FIFO with reinsertion rather than LRU: a segment is freed with one ``unlink`` and never
rewritten in place, so nothing overwrites bytes another process may be reading, writes stay
sequential, and there is no free-slot bookkeeping to keep consistent across processes; the
reinsertion bit gives recently read pages a second life the way CLOCK approximates LRU.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvtier.store.file.journal import OP_EVICT, Entry
from kvtier.store.file.segment import segment_path
from kvtier.store.file.segment_files import owned_by_a_writer
from kvtier.store.record import Verdict

if TYPE_CHECKING:
    from kvtier.store.file.store import FileStore

log = logging.getLogger(__name__)

#: Leftovers younger than this may belong to a process that is creating them right now.
LEFTOVER_AGE_S = 60.0
REINSERT_BATCH = 16


class Evictor:
    """Keeps one store handle's directory within its byte cap and free-space watermark."""

    def __init__(self, store: FileStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._lock_path = store.root / "evict.lock"
        self._inside = threading.local()  # set while this thread evicts (reinsertion writes)

    # ---- capacity ------------------------------------------------------------------------
    def shortfall(self, extra_bytes: int = 0) -> int:
        """Bytes to free before ``extra_bytes`` more fit (<= 0: they fit)."""
        store, options = self.store, self.store.options
        need = -1
        if options.max_bytes is not None:
            used = store.index.used_slots() * store.layout.record_bytes
            need = used + extra_bytes - options.max_bytes
        if options.min_free_bytes:
            fs = os.statvfs(store.root)
            need = max(need, options.min_free_bytes + extra_bytes - fs.f_bavail * fs.f_frsize)
        return need

    def make_room(self, pages: int) -> bool:
        """Evict until ``pages`` more records fit; False if they still do not."""
        extra = pages * self.store.layout.record_bytes
        if self.shortfall(extra) <= 0:
            return True
        if getattr(self._inside, "active", False):
            return False
        self.evict(lambda: self.shortfall(extra) > 0, reinsert=True)
        return self.shortfall(extra) <= 0

    def relieve(self) -> int:
        """Free the oldest evictable segment (after ENOSPC), whatever the cap says; nothing
        when the ENOSPC came from this thread's own reinsertion writes."""
        if getattr(self._inside, "active", False):
            return 0
        budget = iter([True])
        return self.evict(lambda: next(budget, False), reinsert=False)

    def gc(self, target_bytes: int) -> int:
        """Evict (without reinsertion) until segment bytes are at most ``target_bytes``."""
        record = self.store.layout.record_bytes
        return self.evict(lambda: self.store.index.used_slots() * record > target_bytes,
                          reinsert=False)

    # ---- eviction ------------------------------------------------------------------------
    def evict(self, still_over: Callable[[], bool], *, reinsert: bool,
              candidates: list[int] | None = None) -> int:
        """Evict oldest segments (or ``candidates``, in order) while ``still_over()``; returns
        pages dropped."""
        store = self.store
        with self._lock:
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            self._inside.active = True
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                store.refresh()
                active = store.writer.active_ids()
                with store._lock:
                    order = store.index.oldest_segments() if candidates is None else candidates
                dropped = 0
                for seg in order:
                    if not still_over():
                        break
                    if seg in active or owned_by_a_writer(store.segments_dir, seg):
                        continue
                    dropped += self._evict_segment(seg, reinsert)
                return dropped
            finally:
                self._inside.active = False
                os.close(fd)  # drops the flock

    def _evict_segment(self, seg: int, reinsert: bool) -> int:
        store = self.store
        with store._lock:
            live = store.index.live_keys(seg)
            hot = [k for k in live if k in store.index.hot] if reinsert else []
        kept = self._reinsert(seg, hot[:store.layout.slots // 2]) if hot else 0
        # Unlink first: on a full disk the journal append may fail, and the space must come
        # back anyway. A process that still maps keys to the file then reads misses.
        try:
            segment_path(store.segments_dir, seg).unlink(missing_ok=True)
        except OSError as exc:  # not a file we may remove: it stays, and so do its pages
            log.warning("file store %s: cannot evict segment %d: %s", store.root, seg, exc)
            store.counters.add(errors=1)
            return 0
        try:
            store.publish([Entry(OP_EVICT, seg)])
        except OSError:
            store.counters.add(errors=1)
            with store._lock:
                store.index.drop_segment(seg)
        store.counters.add(evicted=len(live) - kept)
        return len(live) - kept

    def _reinsert(self, seg: int, keys: list[bytes]) -> int:
        """Copy ``keys`` (live in ``seg``) forward into the current segment; returns how many."""
        store = self.store
        fd = store.readers.pin(seg)
        if fd is None:
            return 0
        kept = 0
        try:
            for start in range(0, len(keys), REINSERT_BATCH):
                batch = keys[start:start + REINSERT_BATCH]
                pages, good = [], []
                for key in batch:
                    with store._lock:
                        loc = store.index.where.get(key)
                    if loc is None or loc >> 32 != seg:
                        continue
                    page = memoryview(bytearray(store.page_bytes))
                    try:
                        if store.io.read(fd, loc & 0xFFFFFFFF, key, page) is Verdict.OK:
                            pages.append(page)
                            good.append(key)
                    except OSError:
                        continue
                if good:
                    kept += sum(store.write_records(good, pages))
        finally:
            store.readers.unpin(seg)
        return kept

    # ---- crash leftovers -----------------------------------------------------------------
    def clean_leftovers(self) -> int:
        """Remove temp files and segments with no live pages that no process appends to."""
        store = self.store
        cutoff = time.time() - LEFTOVER_AGE_S
        for tmp in store.root.glob(".*.tmp"):
            try:
                if tmp.is_file() and tmp.stat().st_mtime < cutoff:
                    tmp.unlink()
            except OSError:  # gone meanwhile, or not ours to remove
                continue
        with store._lock:
            empty = set(store.index.segments_without_live_pages())

        def is_stale(seg: int) -> bool:
            try:
                return segment_path(store.segments_dir, seg).stat().st_mtime < cutoff
            except FileNotFoundError:
                return True

        stale = sorted(seg for seg in empty if is_stale(seg))
        if stale:
            self.evict(lambda: True, reinsert=False, candidates=stale)
        return len(stale)
