"""The index journal of a ``file://`` store directory, shared by every process that opens it.

Owns the on-disk index: ``journal.<gen>`` (fixed 64-byte entries: put, delete, evict-segment,
new-segment, seal), ``snapshot.<gen>`` (the live index at the start of generation ``gen``, with
the next unused segment id) and ``HEAD`` (the current generation). Every process appends under
an exclusive ``flock`` on the journal and applies entries strictly in journal order, so all
processes agree on which record a key names; reads only tail the journal (one ``fstat`` when
nothing changed). When the journal grows past a bound, the appender holding the lock writes a
snapshot, starts the next generation and seals the old one with an entry pointing at it. Segment
ids are handed out here too (a new-segment entry appended under the lock), so no two processes,
and no two lifetimes of one directory, ever use the same id. Called on IO worker threads (under
the store's locks).

Crash safety: a record is written before its put entry is appended, so a journaled page is
always complete; a failed or short append is truncated away before the lock is released; entries
carry a checksum and a bad one is skipped; a file length that is not a multiple of 64 (a torn
append after power loss) is cut back at open.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import numpy as np
import xxhash

from kvtier.errors import StoreCorrupt
from kvtier.store.quarantine import identity

OP_PUT, OP_DELETE, OP_EVICT, OP_SEAL, OP_SEGMENT = 1, 2, 3, 4, 5
ENTRY_BYTES = 64
_ENTRY = struct.Struct("<B3xII4x32sQ4x")  # op, seg, slot, key, value; then the checksum
assert _ENTRY.size == ENTRY_BYTES - 4
_WORDS = struct.Struct("<15I")
#: Entry checksum: a weighted sum of the entry's 15 little-endian 32-bit words (odd weights),
#: mod 2**32. It catches torn and garbled entries like a crc, and numpy computes it for a
#: million entries at once, which keeps opening a large store fast.
_WEIGHTS = tuple(2 * (0x9E3779B1 * (i + 1) % (1 << 31)) + 1 for i in range(15))
_WEIGHTS_NP = np.array(_WEIGHTS, np.uint32)  # uint32 products wrap mod 2**32, as the sum does
SNAPSHOT_MAGIC = b"KVTSNAP2"  # the header also carries the next unused segment id
_SNAPSHOT_MAGIC_V1 = b"KVTSNAP1"  # older: no segment id (read as 0)
SNAPSHOT_DTYPE = np.dtype([("key", "V32"), ("seg", "<u4"), ("slot", "<u4")])
_ENTRY_DTYPE = np.dtype([("op", "u1"), ("_a", "V3"), ("seg", "<u4"), ("slot", "<u4"),
                         ("_b", "V4"), ("key", "V32"), ("value", "<u8"), ("_c", "V4"),
                         ("check", "<u4")])
assert _ENTRY_DTYPE.itemsize == ENTRY_BYTES
#: Below this many entries a tail is applied one entry at a time.
_BULK_ENTRIES = 64
#: A long journal is read and applied this many bytes at a time (a million entries), which
#: bounds the memory a replay needs beside the index it builds.
_TAIL_BYTES = ENTRY_BYTES << 20
#: magic, rows, xxh3 of the rows (seeded with the next segment id, which it thereby covers),
#: the next segment id.
_SNAP_HEADER = struct.Struct("<8sQQQ32x")
#: The live index as a snapshot: its rows and the next unused segment id.
Snapshot = tuple[np.ndarray, int]


class Entry(NamedTuple):
    op: int
    seg: int = 0
    slot: int = 0
    key: bytes = bytes(32)
    value: int = 0


def _checksum(body: bytes) -> int:
    words: tuple[int, ...] = _WORDS.unpack(body)
    return sum(w * x for w, x in zip(_WEIGHTS, words, strict=True)) & 0xFFFFFFFF


def encode_entry(entry: Entry) -> bytes:
    body = _ENTRY.pack(entry.op, entry.seg, entry.slot, entry.key, entry.value)
    return body + struct.pack("<I", _checksum(body))


def decode_entries(data: bytes) -> Iterator[Entry | None]:
    """Entries of ``data`` (a multiple of 64 bytes); None for one that fails its checksum."""
    for start in range(0, len(data) - ENTRY_BYTES + 1, ENTRY_BYTES):
        body = data[start:start + ENTRY_BYTES - 4]
        (check,) = struct.unpack_from("<I", data, start + ENTRY_BYTES - 4)
        yield Entry(*_ENTRY.unpack(body)) if _checksum(body) == check else None


Apply = Callable[[Entry], None]


class Journal:
    """One process's handle on the shared journal: loads it, tails it, appends to it."""

    def __init__(self, root: Path,
                 apply_rows: Callable[[np.ndarray], None] | None = None) -> None:
        """``apply_rows`` (optional) applies a run of put entries at once, as snapshot rows:
        replaying a long journal at open is then vectorized, not one entry at a time."""
        self.root = root
        self.apply_rows = apply_rows
        self.gen = 0
        self.fd = -1
        self.pos = 0
        self.entries = 0  # entries in the current generation
        self.bad_entries = 0
        #: The directory cannot be written (a read-only mount, no write permission): the
        #: journal is loaded and tailed, every append raises OSError.
        self.read_only = False

    # ---- paths ---------------------------------------------------------------------------
    def _journal(self, gen: int) -> Path:
        return self.root / f"journal.{gen}"

    def _snapshot(self, gen: int) -> Path:
        return self.root / f"snapshot.{gen}"

    def _read_head(self) -> int:
        try:
            text = (self.root / "HEAD").read_bytes()
        except FileNotFoundError:
            return 0
        try:
            return int(text.strip() or 0)
        except ValueError:
            raise StoreCorrupt(f"{self.root / 'HEAD'} does not hold a journal generation "
                               f"number (it holds {text[:40]!r}); the store's index cannot "
                               "be found", identity(self.root)) from None

    # ---- loading -------------------------------------------------------------------------
    def load(self, apply_snapshot: Callable[[np.ndarray, int], None], apply: Apply) -> None:
        """Load the latest snapshot and replay the journal to its end.

        Raises FileNotFoundError when a concurrent compaction removed the generation being
        loaded (the caller starts over with a fresh index).
        """
        gen = self._read_head()
        apply_snapshot(*self.read_snapshot(gen))
        self._open_gen(gen, create=gen == 0)
        self._repair_tail()
        self.tail(apply)

    def read_snapshot(self, gen: int) -> Snapshot:
        """Generation ``gen``'s snapshot: its rows and the next unused segment id."""
        if gen == 0:
            return np.zeros(0, SNAPSHOT_DTYPE), 0
        data = self._snapshot(gen).read_bytes()
        if len(data) < _SNAP_HEADER.size:
            raise OSError(f"{self._snapshot(gen)} is damaged (short)")
        magic, rows, digest, next_seg = _SNAP_HEADER.unpack_from(data)
        body = memoryview(data)[_SNAP_HEADER.size:]
        seed = next_seg if magic == SNAPSHOT_MAGIC else 0
        if magic not in (SNAPSHOT_MAGIC, _SNAPSHOT_MAGIC_V1) \
                or body.nbytes != rows * SNAPSHOT_DTYPE.itemsize \
                or xxhash.xxh3_64_intdigest(body, seed) != digest:
            raise OSError(f"{self._snapshot(gen)} is damaged")
        return np.frombuffer(body, SNAPSHOT_DTYPE), seed

    def _open_gen(self, gen: int, create: bool = False) -> None:
        flags = os.O_RDWR | os.O_APPEND | (os.O_CREAT if create else 0)
        try:
            fd = os.open(self._journal(gen), flags, 0o644)
            self.read_only = False
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES):
                raise
            fd = os.open(self._journal(gen), os.O_RDONLY)  # its pages are served all the same
            self.read_only = True
        if self.fd >= 0:
            os.close(self.fd)
        self.fd, self.gen, self.pos, self.entries = fd, gen, 0, 0

    def _repair_tail(self) -> None:
        """Cut a torn final entry (power loss mid-append) so later appends stay framed."""
        with self.locked():
            size = os.fstat(self.fd).st_size
            if size % ENTRY_BYTES and not self.read_only:  # read only: tail() stops before it
                os.ftruncate(self.fd, size - size % ENTRY_BYTES)

    # ---- tailing -------------------------------------------------------------------------
    def changed(self) -> bool:
        return os.fstat(self.fd).st_size > self.pos

    def tail(self, apply: Apply) -> None:
        """Apply every complete entry appended since the last call, following seals."""
        while True:
            size = os.fstat(self.fd).st_size
            size -= (size - self.pos) % ENTRY_BYTES
            if size <= self.pos:
                return
            data = os.pread(self.fd, min(size - self.pos, _TAIL_BYTES), self.pos)
            self.pos += len(data) - len(data) % ENTRY_BYTES
            sealed = self._apply_all(data, apply)
            if sealed is not None:
                self._open_gen(sealed)

    def _apply_all(self, data: bytes, apply: Apply) -> int | None:
        if self.apply_rows is not None and len(data) >= _BULK_ENTRIES * ENTRY_BYTES:
            return self._apply_bulk(data, apply, self.apply_rows)
        for entry in decode_entries(data):
            self.entries += 1
            if entry is None:
                self.bad_entries += 1
            elif entry.op == OP_SEAL:
                return entry.value
            else:
                apply(entry)
        return None

    def _apply_bulk(self, data: bytes, apply: Apply,
                    apply_rows: Callable[[np.ndarray], None]) -> int | None:
        """``_apply_all`` for long runs: checksums at once, then runs of puts as rows."""
        entries = np.frombuffer(data, _ENTRY_DTYPE, count=len(data) // ENTRY_BYTES)
        words = np.frombuffer(data, "<u4", count=len(entries) * 16).reshape(-1, 16)
        sums = (words[:, :15] * _WEIGHTS_NP).sum(axis=1, dtype=np.uint32)
        good = sums == entries["check"]
        start = 0
        for i in [*np.flatnonzero(~good | (entries["op"] != OP_PUT)).tolist(), len(entries)]:
            if i > start:
                apply_rows(_rows(entries[start:i]))
            self.entries += i - start
            if i == len(entries):
                return None
            self.entries += 1
            start = i + 1
            if not good[i]:
                self.bad_entries += 1
                continue
            entry = Entry(int(entries["op"][i]), int(entries["seg"][i]), int(entries["slot"][i]),
                          entries["key"][i].tobytes(), int(entries["value"][i]))
            if entry.op == OP_SEAL:
                return entry.value
            apply(entry)
        return None

    # ---- appending -----------------------------------------------------------------------
    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the exclusive journal lock of the current generation (following seals)."""
        while True:
            fd = self.fd
            fcntl.flock(fd, fcntl.LOCK_EX)
            if fd == self.fd:
                break
            fcntl.flock(fd, fcntl.LOCK_UN)
        try:
            yield
        finally:
            if fd == self.fd:  # else a seal moved us on and closing the old one unlocked it
                fcntl.flock(fd, fcntl.LOCK_UN)

    def append(self, entries: list[Entry] | Callable[[], list[Entry]], apply: Apply) -> None:
        """Catch up, append ``entries`` and apply them; raises OSError (nothing appended).
        A callable is asked for the entries once caught up, under the lock (for entries that
        depend on everything journaled before them, such as a new segment's id)."""
        while True:
            fd = self.fd
            with self.locked():
                self.tail(apply)
                if fd != self.fd:
                    continue  # a seal moved us to a new generation: lock that one
                if callable(entries):
                    entries = entries()
                self._write_locked([encode_entry(e) for e in entries])
                for entry in entries:
                    apply(entry)
                return

    def _write_locked(self, encoded: list[bytes]) -> None:
        if self.read_only:
            raise OSError(errno.EROFS, f"{self.root} is read-only: nothing is journaled")
        data = b"".join(encoded)
        start = os.fstat(self.fd).st_size
        try:
            written = os.write(self.fd, data)
        except OSError:
            os.ftruncate(self.fd, start)
            raise
        if written != len(data):
            os.ftruncate(self.fd, start)
            raise OSError(28, "short journal append")  # ENOSPC, in practice
        self.pos = start + written
        self.entries += len(encoded)

    # ---- compaction ----------------------------------------------------------------------
    def compact(self, snapshot: Callable[[], Snapshot], apply: Apply) -> bool:
        """Start the next generation from a snapshot of the live index (``snapshot()`` after
        catching up). False when another process holds the lock (it will compact) or a file
        could not be written."""
        fd = self.fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        try:
            self.tail(apply)
            if fd != self.fd:
                return False
            return self._roll(*snapshot())
        finally:
            if fd == self.fd:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def _roll(self, rows: np.ndarray, next_seg: int) -> bool:
        new = self.gen + 1
        try:
            self._write_snapshot(new, rows, next_seg)
            self._journal(new).unlink(missing_ok=True)  # an uncommitted leftover
            os.close(os.open(self._journal(new), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644))
            self._write_locked([encode_entry(Entry(OP_SEAL, value=new))])  # the commit point
        except OSError:
            return False
        _replace_file(self.root / "HEAD", f"{new}\n".encode())
        self._open_gen(new)
        # Keep the generation just sealed, for processes still loading it.
        self._remove_generations(lambda gen: gen < new - 1)
        return True

    # ---- old generations -----------------------------------------------------------------
    def remove_stale_generations(self, apply: Apply) -> int:
        """Delete what a compaction killed midway left behind: generations before the
        current one's predecessor, and uncommitted ones after it. Done under the journal lock
        (no compaction runs meanwhile), once caught up. Returns the bytes freed."""
        while True:
            fd = self.fd
            with self.locked():
                self.tail(apply)
                if fd != self.fd:
                    continue  # a seal moved us on: lock the current generation

                def stale(gen: int, current: int = self.gen) -> bool:
                    return gen < current - 1 or gen > current

                return self._remove_generations(stale)

    def index_bytes(self) -> int:
        """Bytes the index files take on disk (every journal and snapshot generation)."""
        total = 0
        for paths in self._generation_files().values():
            for path in paths:
                try:
                    total += path.stat().st_size
                except FileNotFoundError:
                    continue
        return total

    def _generation_files(self) -> dict[int, list[Path]]:
        found: dict[int, list[Path]] = {}
        for path in self.root.iterdir():
            kind, _, gen = path.name.partition(".")
            if kind in ("journal", "snapshot") and gen.isdigit():
                found.setdefault(int(gen), []).append(path)
        return found

    def _remove_generations(self, stale: Callable[[int], bool]) -> int:
        freed = 0
        for gen, paths in self._generation_files().items():
            if not stale(gen):
                continue
            for path in paths:
                try:
                    size = path.stat().st_size
                    path.unlink()
                    freed += size
                except OSError:  # gone already, or not ours to remove: left as it is
                    continue
        return freed

    def _write_snapshot(self, gen: int, rows: np.ndarray, next_seg: int) -> None:
        body = np.ascontiguousarray(rows, SNAPSHOT_DTYPE).tobytes()
        header = _SNAP_HEADER.pack(SNAPSHOT_MAGIC, len(rows),
                                   xxhash.xxh3_64_intdigest(body, next_seg), next_seg)
        _replace_file(self._snapshot(gen), header + body)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _rows(entries: np.ndarray) -> np.ndarray:
    rows = np.empty(len(entries), SNAPSHOT_DTYPE)
    for name in ("key", "seg", "slot"):
        rows[name] = entries[name]
    return rows


def _replace_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably (temp file, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
