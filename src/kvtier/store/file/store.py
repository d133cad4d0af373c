"""``file://``: the disk tier, a crash-safe page store of append-only segment files.

Owns ``FileStore``: opens (or creates) a store directory, answers ``contains`` from an in-memory
index, reads pages straight into the caller's buffers (one ``preadv`` per run of adjacent
records) and verifies every one, appends writes to this process's own segment, and publishes
them through the shared journal (``journal``) only once their bytes are complete. Several
processes may open one directory at once: each appends to its own segments, and every process
sees the others' pages as soon as it next touches the store (one ``fstat`` of the journal per
call). A record that fails verification is dropped from every index (``damage``), so the
next write stores a good copy. Eviction lives in ``evict`` (acting through a
``site.SegmentSite`` over this handle);
record IO in ``record_io``; the layout in ``segment``. No background threads: the IO worker
threads that call the store do all the work, so nothing can die silently.

Directory::

    kvtier-store.json   layout (page bytes, record alignment, slots per segment)
    HEAD, journal.<g>, snapshot.<g>   the shared index (see journal; rebuilt from the
                        segments' record headers when lost: see rebuild)
    evict.lock          one evicting process at a time
    segments/<id>.seg   records

URL: ``file:///abs/path?max_bytes=64GiB&min_free_bytes=1GiB&segment_bytes=256MiB&verify=full
&direct=false&fsync=false``. ``verify=header`` skips the payload checksum on whole-page reads
(header, key, length and the payload's place are still checked); ``fsync=true`` makes every acknowledged write
durable across power loss (without it, across process crashes). A directory that cannot be
written (a read-only mount, no write permission) opens read-only: its pages are served, every
write is refused (counted).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from itertools import compress
from pathlib import Path

from kvtier.errors import ConfigError, StoreUnavailable
from kvtier.keys import KEY_BYTES
from kvtier.layout import ByteRange
from kvtier.store.base import (
    Buffer,
    PageStore,
    Probe,
    StoreCounters,
    StoreStats,
    readable_view,
    writable_view,
)
from kvtier.store.file.damage import DamagedPages
from kvtier.store.file.evict import Evictor
from kvtier.store.file.health import manifest_identity, probe_file_store
from kvtier.store.file.index import SLOT_BITS, PageIndex
from kvtier.store.file.journal import OP_DELETE, OP_PUT, OP_SEGMENT, Entry, Journal
from kvtier.store.file.options import FileStoreOptions, file_url_path
from kvtier.store.file.rebuild import recover_lost_index
from kvtier.store.file.record_io import RecordIO, plans_of, slot_runs
from kvtier.store.file.segment import list_segments, load_or_create_manifest
from kvtier.store.file.segment_files import SegmentReaders, SegmentWriter, Slot
from kvtier.store.file.site import SegmentSite
from kvtier.store.record import Verdict

log = logging.getLogger(__name__)

#: Reads pinned records into views: (locations, descriptors, keys, views) -> (found per key,
#: corrupt records, IO errors); ``RecordIO.read_many`` or a per-record variant.
Reader = Callable[[list[int | None], dict[int, int | None], Sequence[bytes], list[memoryview]],
                  tuple[list[bool], int, int]]

#: Compact the journal once it holds this many entries more than ``COMPACT_FACTOR`` x live pages.
COMPACT_MIN_ENTRIES = 65536
COMPACT_FACTOR = 4


class FileStore(PageStore):
    """Pages in segment files under one directory, shared safely between processes."""

    scheme = "file"

    def __init__(self, path: str | Path, page_bytes: int,
                 options: FileStoreOptions | None = None) -> None:
        super().__init__(page_bytes)
        self.options = options or FileStoreOptions()
        self.root = Path(path)
        self.segments_dir = self.root / "segments"
        try:
            self.segments_dir.mkdir(parents=True, exist_ok=True)
            self.layout = load_or_create_manifest(self.root, page_bytes, self.options.segment_bytes,
                                                  self.options.max_bytes)
            self.manifest_id = manifest_identity(self.root)
        except StoreUnavailable:
            raise
        except OSError as exc:
            raise StoreUnavailable(f"cannot open file store at {self.root}: {exc}") from None
        if self.options.direct:
            _check_direct_io(self.root)
        self.counters = StoreCounters()
        self._lock = threading.Lock()  # guards the index and the journal handle
        self.readers = SegmentReaders(self.segments_dir, direct=self.options.direct,
                                      max_open=self.options.max_open_files)
        self.io = RecordIO(self.layout, direct=self.options.direct,
                           verify_payload=self.options.verify == "full")
        self.index = PageIndex(on_evict=self.readers.retire)
        self.journal = Journal(self.root, apply_rows=self.index.load_rows)
        self.writer = SegmentWriter(self.segments_dir, self.layout,
                                    new_id=self.new_segment_id,
                                    direct=self.options.direct)
        self.evictor = Evictor(SegmentSite(self))
        self.damage = DamagedPages(self)
        try:
            self.open_seconds = self._load()
            if self.journal.read_only:
                log.warning("file store %s is read-only: its pages are served, every write "
                            "is refused", self.root)
            else:
                self.evictor.clean_leftovers()
        except StoreUnavailable:
            self.close()
            raise
        except OSError as exc:
            self.close()
            raise StoreUnavailable(f"cannot load the index of {self.root}: {exc}") from None

    @classmethod
    def from_url(cls, url: str, page_bytes: int, options: dict[str, object]) -> FileStore:
        return cls(file_url_path(url), page_bytes, FileStoreOptions.parse(options))

    def _load(self) -> float:
        start = time.perf_counter()
        for attempt in range(5):
            try:
                with self._lock:
                    self.journal.load(self.index.load_snapshot, self.index.apply)
                break
            except FileNotFoundError:  # a compaction moved on while we loaded: start over
                if attempt == 4:
                    raise
                self.journal.close()
                self.index = PageIndex(on_evict=self.readers.retire)
                self.journal = Journal(self.root, apply_rows=self.index.load_rows)
        with self._lock:
            rebuilt = recover_lost_index(self.journal, self.index, self.segments_dir, self.layout)
        if rebuilt is not None:
            self.counters.add(recovered=rebuilt.recovered, recovery_skipped=rebuilt.skipped)
            log.warning("file store %s: its index (HEAD, journal, snapshot) was lost; rebuilt it "
                        "from %d segments: %d pages recovered, %d records skipped (torn, corrupt "
                        "or of another format; never served)", self.root, rebuilt.segments,
                        rebuilt.recovered, rebuilt.skipped)
        with self._lock:
            freed = self.journal.remove_stale_generations(self.index.apply)
        if freed:
            log.warning("file store %s: removed %d bytes of old index generations left by an "
                        "interrupted compaction", self.root, freed)
        on_disk = list_segments(self.segments_dir)
        with self._lock:
            for seg in set(self.index.seg_slots) - set(on_disk):
                self.index.drop_segment(seg)  # unlinked by an eviction that did not journal
            self.index.note_segment_files(on_disk, self.layout.segment_slots_in)
        return time.perf_counter() - start

    @property
    def index_lock(self) -> threading.Lock:
        """The lock that guards the index and the journal handle (the evictor's site takes it)."""
        return self._lock

    # ---- index upkeep --------------------------------------------------------------------
    def refresh(self) -> None:
        """Apply what other processes appended to the journal since the last call."""
        try:
            changed = self.journal.changed()
        except OSError:
            changed = True  # the journal handle moved to a new generation under us
        if changed:
            with self._lock:
                self.journal.tail(self.index.apply)

    def publish(self, entries: list[Entry] | Callable[[], list[Entry]]) -> None:
        """Append ``entries`` to the journal and apply them; raises OSError if nothing was."""
        with self._lock:
            self.journal.append(entries, self.index.apply)
            if self.journal.entries > COMPACT_MIN_ENTRIES + COMPACT_FACTOR * len(self.index.where):
                self.journal.compact(self.index.snapshot, self.index.apply)

    def new_segment_id(self) -> int:
        """An id no segment of this directory ever had, journaled before it is used (so every
        process, and every later opening, sees it taken); raises OSError."""
        taken: list[int] = []

        def entry() -> list[Entry]:
            taken.append(self.index.max_seg + 1)  # caught up under the journal lock
            return [Entry(OP_SEGMENT, taken[-1])]

        self.publish(entry)
        return taken[-1]

    # ---- the contract --------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self._check_open()
        self.refresh()
        where = self.index.where
        return [k in where for k in keys]

    def read_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        self._check_batch(keys, buffers)
        page_bytes = self.page_bytes
        views = [b if type(b) is memoryview and b.nbytes == page_bytes and b.ndim == 1
                 and b.format == "B" and b.c_contiguous and not b.readonly
                 else writable_view(b, page_bytes)
                 for b in buffers]  # a flat writable byte view as is (the hot path)
        return self._read(keys, views, self.io.read_many)

    def read_ranges_into(self, keys: Sequence[bytes], ranges: Sequence[ByteRange],
                         buffers: Sequence[Buffer]) -> list[bool]:
        self._check_batch(keys, buffers)
        views = [writable_view(b, sum(r.length for r in ranges)) for b in buffers]
        runs = self.io.chunk_cover(ranges)

        def one(fd: int, slot: int, key: bytes, view: memoryview) -> Verdict:
            if runs is None:
                return self.io.read_whole_then_pack(fd, slot, key, ranges, view)
            return self.io.read_chunks(fd, slot, key, runs, ranges, view)

        return self._read(keys, views, lambda locs, fds, ks, vs: self.io.each(
            plans_of(locs, fds), ks, vs, one))

    def _read(self, keys: Sequence[bytes], views: list[memoryview], reader: Reader) -> list[bool]:
        self.refresh()
        locs, fds = self._pin(keys)
        try:
            found, corrupt, errors = reader(locs, fds, keys, views)
        finally:
            for seg, fd in fds.items():
                if fd is not None:
                    self.readers.unpin(seg)
        hits = sum(found)
        if hits:
            with self._lock:
                self.index.hot.update(keys if hits == len(keys) else compress(keys, found))
        self.counters.add(hits=hits, misses=len(keys) - hits, corrupt=corrupt, errors=errors,
                          bytes_read=hits * self.page_bytes)
        if hits < len(keys) and hits + errors < len(keys) - locs.count(None):
            self.damage.drop(keys, locs, found, errors)  # torn, corrupt or gone: never again
        return found

    def _pin(self, keys: Sequence[bytes]) -> tuple[list[int | None], dict[int, int | None]]:
        """Each key's record location (``seg << 32 | slot``; None: a miss) and a descriptor of
        each segment they name (None: the segment is gone), pinned: the caller unpins those
        once its reads are done."""
        with self._lock:
            locs = list(map(self.index.where.get, keys))
            segs = {loc >> SLOT_BITS for loc in locs if loc is not None}
            return locs, {seg: self.readers.pin(seg) for seg in segs}

    def write(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        self._check_batch(keys, buffers)
        views = [readable_view(b, self.page_bytes) for b in buffers]
        for key in keys:
            if len(key) != KEY_BYTES:
                raise ValueError(f"a page key is {KEY_BYTES} bytes, got {len(key)}")
        if not keys:
            return []
        if self.journal.read_only:  # nothing can be journaled: refused before any IO
            self.counters.add(refused=len(keys))
            return [False] * len(keys)
        if not self.evictor.make_room(len(keys)):
            self.counters.add(refused=len(keys))
            return [False] * len(keys)
        return self.write_records([bytes(k) for k in keys], views)

    def write_records(self, keys: list[bytes], views: list[memoryview]) -> list[bool]:
        """Append records and publish them (no capacity check: the evictor reinserts here)."""
        results = [False] * len(keys)
        try:
            slots = self.writer.reserve(len(keys))
        except OSError:
            self.counters.add(refused=len(keys), errors=len(keys))
            return results
        done: list[int] = []
        errors = 0
        try:
            for first, last in slot_runs(slots, self.io.max_run):
                head = slots[first]
                if last - first > 1 and head.direct_fd is None:
                    try:  # the run at once: two system calls, not two per record
                        self.io.write_run(head.fd, head.slot, keys[first:last], views[first:last])
                        done.extend(range(first, last))
                        continue
                    except OSError:
                        pass  # again record by record, to learn which failed
                for i in range(first, last):
                    slot = slots[i]
                    try:
                        self.io.write(slot.fd, slot.direct_fd, slot.slot, keys[i], views[i])
                        done.append(i)
                    except OSError as exc:
                        errors += 1
                        self._on_write_error(exc)
            if done:
                errors += self._publish_puts(keys, slots, done, results)
        finally:
            self.writer.release(slots)
        ok = sum(results)
        self.counters.add(refused=len(keys) - ok, errors=errors, bytes_written=ok * self.page_bytes)
        return results

    def _publish_puts(self, keys: list[bytes], slots: list[Slot], done: list[int],
                      results: list[bool]) -> int:
        try:
            if self.options.fsync:
                for fd in {slots[i].fd for i in done}:
                    os.fdatasync(fd)  # the file's data, O_DIRECT payloads included
            self.publish([Entry(OP_PUT, slots[i].seg, slots[i].slot, keys[i]) for i in done])
            if self.options.fsync:
                os.fdatasync(self.journal.fd)
        except OSError as exc:
            self._on_write_error(exc)
            return len(done)
        for i in done:
            results[i] = True
        return 0

    def _on_write_error(self, exc: OSError) -> None:
        """A full or failing disk: stop appending to this segment and free some space."""
        self.writer.abandon_current()
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            self.evictor.relieve()

    def delete(self, keys: Sequence[bytes]) -> int:
        self._check_open()
        self.refresh()
        with self._lock:
            present = [k for k in dict.fromkeys(bytes(k) for k in keys) if k in self.index.where]
        if not present:
            return 0
        try:
            self.publish([Entry(OP_DELETE, key=k) for k in present])
        except OSError:
            self.counters.add(errors=1)
            return 0
        return len(present)

    def stats(self) -> StoreStats:
        pages = len(self.index.where)
        return StoreStats(backend=self.scheme, pages=pages, bytes=pages * self.page_bytes,
                          capacity_bytes=self.options.max_bytes, **self.counters.snapshot())

    def probe(self) -> Probe:
        """Whether the directory is still the one opened, and what bounds its writes."""
        return probe_file_store(self)

    def resize(self, max_bytes: int | None, wait_s: float = 5.0) -> dict[str, object]:
        """Set the cap on segment bytes now; a shrink evicts oldest segments (no reinsertion)
        until the store fits, and returns when it does or ``wait_s`` ran out. Never a victim:
        a segment being appended to (the current ones are sealed, and go once their writes
        land) or one a read of this handle holds open (it goes once the read is done)."""
        self._check_open()
        self.options = dataclasses.replace(self.options, max_bytes=max_bytes)
        before = self.disk_usage()["segment_bytes"]
        deadline = time.monotonic() + wait_s
        while max_bytes is not None and self.disk_usage()["segment_bytes"] > max_bytes:
            with self._lock:
                order = self.index.oldest_segments()
            idle = [seg for seg in order if not self.readers.pinned(seg)]
            self.evictor.evict(lambda: self.disk_usage()["segment_bytes"] > max_bytes,
                               reinsert=False, candidates=idle)
            if self.disk_usage()["segment_bytes"] <= max_bytes or time.monotonic() > deadline:
                break
            self.writer.seal_all()
            time.sleep(0.005)
        after = self.disk_usage()["segment_bytes"]
        return {"segment_bytes_before": before, "segment_bytes_after": after,
                "fits": max_bytes is None or after <= max_bytes}

    def clear(self) -> int:
        """Delete every page (journaled: every process sees it) and free the segments no writer
        holds. Returns the pages deleted."""
        self._check_open()
        self.refresh()
        with self._lock:
            keys = list(self.index.where)
        removed = self.delete(keys) if keys else 0
        self.writer.seal_all()
        self.evictor.gc(0)
        return removed

    def disk_usage(self) -> dict[str, float]:
        """Space on disk: segment bytes (live and dead records), filesystem free bytes."""
        self.refresh()
        with self._lock:
            segments = len(self.index.seg_slots)
            used = self.index.used_slots() * self.layout.record_bytes
        fs = os.statvfs(self.root)
        return {"segments": segments, "segment_bytes": used,
                "index_bytes": self.journal.index_bytes(),
                "live_bytes": len(self.index.where) * self.layout.record_bytes,
                "fs_free_bytes": fs.f_bavail * fs.f_frsize, "record_bytes": self.layout.record_bytes,
                "journal_generation": self.journal.gen, "journal_entries": self.journal.entries,
                "open_seconds": self.open_seconds}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.writer.close()
        self.readers.close()
        with self._lock:
            self.journal.close()


def _check_direct_io(root: Path) -> None:
    """Raise ConfigError unless the filesystem under ``root`` accepts O_DIRECT (tmpfs does not)."""
    try:
        os.close(os.open(root / "kvtier-store.json", os.O_RDONLY | os.O_DIRECT))
    except OSError as exc:
        raise ConfigError("direct", True, f"a filesystem that supports O_DIRECT ({exc.strerror})") \
            from None
