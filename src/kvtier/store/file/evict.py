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

The evictor decides (which segments, when, how many pages to copy forward, what is a leftover);
what it acts on is a ``Site``, the few operations a store handle offers it (``FileStore``
provides them through ``site.SegmentSite``), so it never touches the store's index, locks or
descriptors.

Why FIFO with reinsertion rather than LRU: a segment is freed with one ``unlink`` and never
rewritten in place, so nothing overwrites bytes another process may be reading, writes stay
sequential, and there is no free-slot bookkeeping to keep consistent across processes; the
reinsertion bit gives recently read pages a second life the way CLOCK approximates LRU.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from kvtier.store.base import StoreCounters

#: Leftovers younger than this may belong to a process that is creating them right now.
LEFTOVER_AGE_S = 60.0


class Site(Protocol):
    """What eviction needs of a store handle. Every method is safe beside IO workers."""

    root: Path                # the store directory (evict.lock, free space, temp files)
    counters: StoreCounters   # ``evicted`` and ``errors`` are counted here

    def capacity(self) -> tuple[int | None, int]:
        """(``max_bytes`` or None, ``min_free_bytes``) as configured now."""

    def used_bytes(self) -> int:
        """Disk bytes the segments' used slots take (live and dead records)."""

    @property
    def record_bytes(self) -> int:
        """Disk bytes one more record takes."""

    @property
    def reinsert_limit(self) -> int:
        """Pages one victim may copy forward at most (half a segment: eviction progresses)."""

    def catch_up(self) -> None:
        """Apply what other processes journaled (the evict lock is held meanwhile)."""

    def oldest_segments(self) -> list[int]:
        """Segment ids, oldest first."""

    def in_use(self, seg: int) -> bool:
        """True while some process may still append to ``seg``: never a victim."""

    def live_pages(self, seg: int) -> tuple[int, list[bytes]]:
        """(live pages in ``seg``, those of them read since they were written)."""

    def copy_forward(self, seg: int, keys: list[bytes]) -> int:
        """Copy live ``keys`` of ``seg`` into the current segment; returns how many moved."""

    def remove_segment(self, seg: int) -> bool:
        """Unlink ``seg`` and journal its eviction (every index forgets it); False if the file
        could not be removed (it stays, with its pages)."""

    def segments_without_live_pages(self) -> list[int]:
        """Segments that hold only dead records."""

    def segment_mtime(self, seg: int) -> float | None:
        """Modification time of ``seg``'s file (None: it is gone)."""


class Evictor:
    """Keeps one store handle's directory within its byte cap and free-space watermark."""

    def __init__(self, site: Site) -> None:
        self.site = site
        self._lock = threading.Lock()
        self._lock_path = site.root / "evict.lock"
        self._inside = threading.local()  # set while this thread evicts (reinsertion writes)

    # ---- capacity ------------------------------------------------------------------------
    def shortfall(self, extra_bytes: int = 0) -> int:
        """Bytes to free before ``extra_bytes`` more fit (<= 0: they fit)."""
        max_bytes, min_free_bytes = self.site.capacity()
        need = -1
        if max_bytes is not None:
            need = self.site.used_bytes() + extra_bytes - max_bytes
        if min_free_bytes:
            fs = os.statvfs(self.site.root)
            need = max(need, min_free_bytes + extra_bytes - fs.f_bavail * fs.f_frsize)
        return need

    def make_room(self, pages: int) -> bool:
        """Evict until ``pages`` more records fit; False if they still do not."""
        extra = pages * self.site.record_bytes
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
        return self.evict(lambda: self.site.used_bytes() > target_bytes, reinsert=False)

    # ---- eviction ------------------------------------------------------------------------
    def evict(self, still_over: Callable[[], bool], *, reinsert: bool,
              candidates: list[int] | None = None) -> int:
        """Evict oldest segments (or ``candidates``, in order) while ``still_over()``; returns
        pages dropped."""
        site = self.site
        with self._lock:
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            self._inside.active = True
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                site.catch_up()
                order = site.oldest_segments() if candidates is None else candidates
                dropped = 0
                for seg in order:
                    if not still_over():
                        break
                    if not site.in_use(seg):
                        dropped += self._evict_segment(seg, reinsert)
                return dropped
            finally:
                self._inside.active = False
                os.close(fd)  # drops the flock

    def _evict_segment(self, seg: int, reinsert: bool) -> int:
        site = self.site
        live, hot = site.live_pages(seg)
        kept = site.copy_forward(seg, hot[:site.reinsert_limit]) if reinsert and hot else 0
        if not site.remove_segment(seg):
            return 0
        site.counters.add(evicted=live - kept)
        return live - kept

    # ---- crash leftovers -----------------------------------------------------------------
    def clean_leftovers(self) -> int:
        """Remove temp files and segments with no live pages that no process appends to."""
        site = self.site
        cutoff = time.time() - LEFTOVER_AGE_S
        for tmp in site.root.glob(".*.tmp"):
            try:
                if tmp.is_file() and tmp.stat().st_mtime < cutoff:
                    tmp.unlink()
            except OSError:  # gone meanwhile, or not ours to remove
                continue
        stale = sorted(seg for seg in site.segments_without_live_pages()
                       if (mtime := site.segment_mtime(seg)) is None or mtime < cutoff)
        if stale:
            self.evict(lambda: True, reinsert=False, candidates=stale)
        return len(stale)
