"""The in-memory index of a ``file://`` store handle, rebuilt from the shared journal.

Owns ``PageIndex``: key -> location of the live record (segment id << 32 | slot), the keys put
into each segment (for eviction), each segment's high-water slot (for disk accounting), the
keys read since they were written (the reinsertion bit of FIFO-with-reinsertion) and the highest
segment id the directory ever used (raised by every entry naming a segment and carried through
snapshots, so an id is never handed out twice), and whether a rebuild of the index from the
segments (``rebuild``) was begun and not finished. It changes
only by applying journal entries, in journal order, so every process sharing a directory
converges on the same mapping. Not thread-safe: ``FileStore`` guards it with its index lock.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvtier.store.file.journal import (
    OP_DELETE,
    OP_EVICT,
    OP_PUT,
    OP_SEGMENT,
    SNAPSHOT_DTYPE,
    Entry,
    Snapshot,
)

SLOT_BITS = 32
SLOT_MASK = (1 << SLOT_BITS) - 1
#: Values of the segment entries that open and close an index rebuilt from the segments
#: (``rebuild``); a segment entry handing out one id carries 0.
REBUILD_BEGIN, REBUILD_DONE = 1, 2


def location(seg: int, slot: int) -> int:
    return seg << SLOT_BITS | slot


def split(loc: int) -> tuple[int, int]:
    return loc >> SLOT_BITS, loc & SLOT_MASK


class PageIndex:
    """Which record holds each live page, and what each segment holds."""

    def __init__(self, on_evict: Callable[[int], None] = lambda seg: None) -> None:
        self.where: dict[bytes, int] = {}
        self.seg_keys: dict[int, list[bytes]] = {}
        self.seg_slots: dict[int, int] = {}
        self.hot: set[bytes] = set()
        self.total_slots = 0  # sum of seg_slots, kept as a running total
        self.max_seg = -1  # the highest segment id ever used in the directory
        self.rebuilding = False  # the journal began a rebuild from the segments, not ended it
        self._on_evict = on_evict

    # ---- journal entries -----------------------------------------------------------------
    def apply(self, entry: Entry) -> None:
        if entry.op == OP_PUT:
            self.put(entry.key, entry.seg, entry.slot)
        elif entry.op == OP_DELETE:
            self.where.pop(entry.key, None)
            self.hot.discard(entry.key)
        elif entry.op == OP_EVICT:
            self.max_seg = max(self.max_seg, entry.seg)
            self.drop_segment(entry.seg)
        elif entry.op == OP_SEGMENT:
            self.max_seg = max(self.max_seg, entry.seg)
            if entry.value in (REBUILD_BEGIN, REBUILD_DONE):
                self.rebuilding = entry.value == REBUILD_BEGIN

    def put(self, key: bytes, seg: int, slot: int) -> None:
        self.where[key] = location(seg, slot)
        self.hot.discard(key)
        keys = self.seg_keys.get(seg)
        if keys is None:
            keys = self.seg_keys[seg] = []
        keys.append(key)
        used = self.seg_slots.get(seg, 0)
        if slot >= used:
            self.seg_slots[seg] = slot + 1
            self.total_slots += slot + 1 - used
        if seg > self.max_seg:
            self.max_seg = seg

    def drop_segment(self, seg: int) -> list[bytes]:
        """Forget segment ``seg``; returns the live keys that were in it."""
        dropped = []
        for key in self.seg_keys.pop(seg, ()):
            loc = self.where.get(key)
            if loc is not None and loc >> SLOT_BITS == seg:
                del self.where[key]
                self.hot.discard(key)
                dropped.append(key)
        self.total_slots -= self.seg_slots.pop(seg, 0)
        self._on_evict(seg)
        return dropped

    # ---- snapshots -----------------------------------------------------------------------
    def load_snapshot(self, rows: np.ndarray, next_seg: int) -> None:
        """Apply a snapshot: its rows, and the next unused segment id it carries."""
        self.max_seg = max(self.max_seg, next_seg - 1)
        self.load_rows(rows)

    def snapshot(self) -> Snapshot:
        """The live index as a snapshot (rows, next unused segment id)."""
        return self.rows(), self.max_seg + 1

    def load_rows(self, rows: np.ndarray) -> None:
        """Apply puts given as snapshot rows, in order (a snapshot, or a run of journal puts);
        vectorized, so a million rows load in about a second."""
        if not len(rows):
            return
        segs = rows["seg"].astype(np.uint64)
        locs = (segs << np.uint64(SLOT_BITS)) | rows["slot"].astype(np.uint64)
        keys = rows["key"].tolist()
        self.where.update(zip(keys, locs.tolist(), strict=True))
        if self.hot:
            self.hot.difference_update(keys)
        shared = np.empty(len(keys), object)  # the same bytes objects as ``where`` holds
        shared[:] = keys
        order = np.argsort(rows["seg"], kind="stable")
        sorted_segs = rows["seg"][order]
        bounds = np.flatnonzero(np.diff(sorted_segs)) + 1
        for chunk in np.split(order, bounds):
            seg = int(rows["seg"][chunk[0]])
            self.seg_keys.setdefault(seg, []).extend(shared[chunk].tolist())
            self._grow(seg, int(rows["slot"][chunk].max()) + 1)

    def rows(self) -> np.ndarray:
        """The live index as snapshot rows."""
        rows = np.zeros(len(self.where), SNAPSHOT_DTYPE)
        if not self.where:
            return rows
        rows["key"] = np.frombuffer(b"".join(self.where), "V32")
        locs = np.fromiter(self.where.values(), np.uint64, len(self.where))
        rows["seg"] = locs >> np.uint64(SLOT_BITS)
        rows["slot"] = locs & np.uint64(SLOT_MASK)
        return rows

    def note_segment_files(self, sizes: dict[int, int], slots_in: Callable[[int], int]) -> None:
        """Count segment files found on disk (their slots hold space even when dead);
        ``slots_in(file_bytes)`` says how many slots a file of that size has used."""
        for seg, size in sizes.items():
            self._grow(seg, slots_in(size))

    def _grow(self, seg: int, slots: int) -> None:
        used = self.seg_slots.get(seg, 0)
        if slots > used or seg not in self.seg_slots:
            self.seg_slots[seg] = max(slots, used)
            self.total_slots += max(slots, used) - used
        self.max_seg = max(self.max_seg, seg)

    # ---- queries -------------------------------------------------------------------------
    def used_slots(self) -> int:
        return self.total_slots

    def segments_without_live_pages(self) -> list[int]:
        """Segments that hold only dead records (overwritten, deleted, or never published)."""
        segs = np.fromiter(self.where.values(), np.uint64, len(self.where)) >> np.uint64(SLOT_BITS)
        segs.sort()
        live = set(segs[np.flatnonzero(np.diff(segs, append=segs[-1:] + 1))].tolist())
        return [seg for seg in self.seg_slots if seg not in live]

    def live_keys(self, seg: int) -> list[bytes]:
        """Keys whose live record is in segment ``seg`` (each once)."""
        return [k for k in dict.fromkeys(self.seg_keys.get(seg, ()))
                if (loc := self.where.get(k)) is not None and loc >> SLOT_BITS == seg]

    def oldest_segments(self) -> list[int]:
        return sorted(self.seg_slots)
