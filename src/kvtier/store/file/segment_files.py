"""Open segment files of one ``file://`` store handle: pinned read descriptors and the segment
this process appends to.

Owns ``SegmentReaders`` (a bounded cache of read-only descriptors; a read pins its segment, so
an eviction that unlinks the file never pulls the bytes from under it: the descriptor keeps the
inode alive until the last reader lets go, then it is closed and forgotten) and
``SegmentWriter`` (hands out slots of this process's own active segment to concurrent writer
threads; the segment is held with an exclusive ``flock`` while it can still receive records,
which tells other processes not to evict or clean it). Both are thread-safe; called from IO
worker threads."""

from __future__ import annotations

import fcntl
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.store.file.segment import RecordLayout, segment_path


class SegmentReaders:
    """Read descriptors by segment id, at most ``max_open`` kept open while unpinned."""

    def __init__(self, directory: Path, *, direct: bool = False, max_open: int = 256) -> None:
        self.directory = directory
        self.flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
        self.max_open = max_open
        self._lock = threading.Lock()
        self._fds: OrderedDict[int, list[int]] = OrderedDict()  # seg -> [fd, pins]
        self._retiring: set[int] = set()  # evicted, still pinned: closed by the last unpin

    def pin(self, seg: int) -> int | None:
        """A descriptor of segment ``seg``, held open until ``unpin``; None if it is gone."""
        with self._lock:
            if seg in self._retiring:
                return None
            slot = self._fds.get(seg)
            if slot is None:
                try:
                    fd = os.open(segment_path(self.directory, seg), self.flags)
                except FileNotFoundError:
                    return None
                slot = self._fds[seg] = [fd, 1]
                self._trim()
            else:
                self._fds.move_to_end(seg)
                slot[1] += 1
            return slot[0]

    def unpin(self, seg: int) -> None:
        with self._lock:
            slot = self._fds[seg]
            slot[1] -= 1
            if slot[1] == 0 and seg in self._retiring:
                self._retiring.discard(seg)
                os.close(self._fds.pop(seg)[0])

    def pinned(self, seg: int) -> bool:
        """True while a read of this handle holds segment ``seg`` open."""
        with self._lock:
            slot = self._fds.get(seg)
            return slot is not None and slot[1] > 0

    def retire(self, seg: int) -> None:
        """The segment was evicted: close its descriptor once no read holds it. Nothing is
        remembered after that (segment ids are never reused, so no later pin names it)."""
        with self._lock:
            slot = self._fds.get(seg)
            if slot is None:
                return
            if slot[1] == 0:
                os.close(self._fds.pop(seg)[0])
            else:
                self._retiring.add(seg)

    def _trim(self) -> None:
        if len(self._fds) <= self.max_open:
            return
        for seg in [s for s, (_, pins) in self._fds.items() if pins == 0]:
            os.close(self._fds.pop(seg)[0])
            if len(self._fds) <= self.max_open // 2:
                return

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._retiring.clear()


@dataclass
class _Active:
    seg: int
    fd: int
    direct_fd: int | None
    next_slot: int = 0
    in_flight: int = 0
    full: bool = False


@dataclass(frozen=True)
class Slot:
    """Where one record goes: segment id, slot, and the descriptors to write it through."""

    seg: int
    slot: int
    fd: int
    direct_fd: int | None  # O_DIRECT descriptor for the payload, when the store uses it


#: Segments a process appends to at once. Buffered writes to one file serialize on its inode
#: lock, so writer threads get a segment each (up to this many, then they share).
WRITE_LANES = 4


@dataclass
class SegmentWriter:
    """Reserves slots in this process's active segments (one per writer thread, up to
    ``WRITE_LANES``); starts a new segment when one fills."""

    directory: Path
    layout: RecordLayout
    new_id: Callable[[], int]  # a segment id never used before (journaled); raises OSError
    direct: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _open: dict[int, _Active] = field(default_factory=dict)
    _current: dict[int, _Active] = field(default_factory=dict)  # lane -> segment
    _lanes: dict[int, int] = field(default_factory=dict)  # thread id -> lane

    def _lane(self) -> int:
        ident = threading.get_ident()
        lane = self._lanes.get(ident)
        if lane is None:
            lane = self._lanes[ident] = len(self._lanes) % WRITE_LANES
        return lane

    def reserve(self, count: int) -> list[Slot]:
        """``count`` slots, in order; pair each with ``release`` once its record is journaled.

        Raises OSError when a new segment cannot be created (ENOSPC, EIO).
        """
        slots: list[Slot] = []
        with self._lock:
            lane = self._lane()
            while len(slots) < count:
                active = self._current.get(lane)
                if active is None or active.full:
                    active = self._current[lane] = self._create()
                    self._open[active.seg] = active
                take = min(count - len(slots), self.layout.slots - active.next_slot)
                slots += [Slot(active.seg, s, active.fd, active.direct_fd)
                          for s in range(active.next_slot, active.next_slot + take)]
                active.next_slot += take
                active.in_flight += take
                active.full = active.next_slot >= self.layout.slots
        return slots

    def release(self, slots: list[Slot]) -> None:
        """The records in ``slots`` are journaled (or abandoned); seal segments that are done."""
        with self._lock:
            for slot in slots:
                active = self._open[slot.seg]
                active.in_flight -= 1
                if active.full and active.in_flight == 0:
                    self._seal(active)

    def active_ids(self) -> set[int]:
        with self._lock:
            return set(self._open)

    def abandon_current(self) -> None:
        """Stop appending to this thread's segment (after a write error on it)."""
        with self._lock:
            active = self._current.get(self._lane())
            if active is not None and not active.full:
                active.full = True
                if active.in_flight == 0:
                    self._seal(active)

    def seal_all(self) -> None:
        """Stop appending to every current segment (a shrink or a clear of the store); each
        is sealed now, or by ``release`` once the writes in it land."""
        with self._lock:
            for active in list(self._current.values()):
                if active.seg not in self._open:
                    continue  # filled and sealed already
                active.full = True
                if active.in_flight == 0:
                    self._seal(active)
            self._current.clear()

    def _create(self) -> _Active:
        while True:
            seg = self.new_id()
            path = segment_path(self.directory, seg)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:  # not ours (a stray file or directory): take the next id
                continue
            fcntl.flock(fd, fcntl.LOCK_EX)
            direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT) if self.direct else None
            return _Active(seg, fd, direct_fd)

    def _seal(self, active: _Active) -> None:
        self._open.pop(active.seg, None)
        if active.direct_fd is not None:
            os.close(active.direct_fd)
        os.close(active.fd)  # closing drops the flock: the segment may now be evicted

    def close(self) -> None:
        with self._lock:
            for active in list(self._open.values()):
                self._seal(active)
            self._current.clear()


def owned_by_a_writer(directory: Path, seg: int) -> bool:
    """True while some process (this one included) may still append to segment ``seg``."""
    try:
        fd = os.open(segment_path(directory, seg), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
