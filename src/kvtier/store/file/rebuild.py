"""Rebuilding the lost index of a ``file://`` store directory from its segments' record headers.

Owns ``recover_lost_index``: when a directory with a valid manifest holds segment files but
its index is gone (no ``HEAD``, no ``snapshot.*``, no journal generation but the ``journal.0``
this opening just created, and that one empty), every segment is scanned and each record that
verifies (header crc, magic, current format version, the payload's place and length, payload
checksum, chunk table) is journaled as a put, so every process sharing the directory agrees on
the rebuilt index. Anything else is skipped and counted, never indexed.

Why these conditions mean "lost" and nothing else: the journal is created before anything is
written into a directory, and a segment id is journaled before its file is created, so in a
directory that was never damaged a segment file always sits beside a non-empty journal (or a
``HEAD`` once compacted). A fresh directory, or one another process is creating right now, has
an empty journal and no segment file. The decision is taken again under the journal's
exclusive lock, once caught up, so two processes opening a damaged directory at once rebuild it
once.

Journal shape of a rebuild (one append, under the lock): a segment entry marked
``REBUILD_BEGIN`` naming the highest segment id found on disk (so ids handed out afterwards never
name a scanned segment), the puts in (segment, slot) order (where a key has several records, the
newest segment's wins), then a segment entry marked ``REBUILD_DONE``. A kill -9 midway leaves a
journal that begins a rebuild and never finishes it: the next opening (any process) sees that
and rebuilds again, journaling only the puts the partial one missed.

What a rebuild cannot know: deletes and evictions journaled before the index was lost are not
in the segments, so a page deleted (not evicted) from a segment that still exists comes back.
Pages are content-addressed (the key names the bytes), so such a page is still a right page.

Runs on the thread that opens the store, under the store's index lock.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvtier.store.file.index import REBUILD_BEGIN, REBUILD_DONE, PageIndex, location
from kvtier.store.file.journal import OP_PUT, OP_SEGMENT, Entry, Journal
from kvtier.store.file.segment import RecordLayout, list_segments, segment_path
from kvtier.store.record import HEADER_BYTES, Verdict

_KEY_AT = 28  # the page key's offset in a record header (``kvtier.store.record``)


@dataclass(frozen=True)
class Rebuilt:
    """What a rebuild found: records journaled, records skipped, segments scanned."""

    recovered: int
    skipped: int
    segments: int


def _no_index_files(root: Path) -> bool:
    """No ``HEAD``, no snapshot, no journal generation other than ``journal.0``."""
    if (root / "HEAD").exists():
        return False
    for path in root.iterdir():
        kind, _, gen = path.name.partition(".")
        if kind in ("journal", "snapshot") and gen.isdigit() and path.name != "journal.0":
            return False
    return True


def index_lost(journal: Journal, index: PageIndex, segments_dir: Path) -> bool:
    """Whether the index looks lost (or a rebuild was interrupted), as loaded: cheap, taken
    again under the journal lock before anything is written."""
    if index.rebuilding:
        return True
    if journal.gen != 0 or journal.pos != 0 or os.fstat(journal.fd).st_size != 0:
        return False
    return bool(list_segments(segments_dir)) and _no_index_files(journal.root)


def recover_lost_index(journal: Journal, index: PageIndex, segments_dir: Path,
                       layout: RecordLayout) -> Rebuilt | None:
    """Rebuild the index from the segments if it is lost (see the module docstring); None
    when it is not (or another process rebuilt it first). Raises OSError when the journal
    cannot take the rebuild (nothing is then journaled, or a valid prefix that the next
    opening completes)."""
    if journal.read_only or not index_lost(journal, index, segments_dir):
        return None
    found: list[Rebuilt] = []

    def entries() -> list[Entry]:  # caught up, under the exclusive journal lock
        resume = index.rebuilding
        if not resume and not (journal.gen == 0 and os.fstat(journal.fd).st_size == 0
                               and _no_index_files(journal.root)):
            return []
        on_disk = sorted(list_segments(segments_dir))
        if not on_disk and not resume:
            return []
        last = max(on_disk[-1] if on_disk else 0, index.max_seg, 0)
        puts: list[Entry] = []
        skipped = 0
        for seg in on_disk:
            good, bad = scan_segment(segment_path(segments_dir, seg), seg, layout)
            puts += good
            skipped += bad
        found.append(Rebuilt(len(puts), skipped, len(on_disk)))
        where = index.where
        missing = [e for e in puts if where.get(e.key) != location(e.seg, e.slot)]
        head = [] if resume else [Entry(OP_SEGMENT, last, value=REBUILD_BEGIN)]
        return [*head, *missing, Entry(OP_SEGMENT, last, value=REBUILD_DONE)]

    journal.append(entries, index.apply)
    return found[0] if found else None


def scan_segment(path: Path, seg: int, layout: RecordLayout) -> tuple[list[Entry], int]:
    """Put entries for the records of one segment file that verify, in slot order, and how
    many of its used slots hold none (torn, corrupt, of another format, unreadable)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:  # removed while we scanned: nothing of it to index
        return [], 0
    try:
        used = min(layout.slots, layout.segment_slots_in(os.fstat(fd).st_size))
        good: list[Entry] = []
        stride = layout.header_stride
        headers = os.pread(fd, used * stride, 0)
        for slot in range(used):
            header = headers[slot * stride:(slot + 1) * stride]
            if len(header) == stride and _verified(fd, layout, slot, header):
                key = header[_KEY_AT:_KEY_AT + 32]
                good.append(Entry(OP_PUT, seg, slot, key))
        return good, used - len(good)
    except OSError:  # an unreadable segment: none of its records can be vouched for
        return [], layout.segment_slots_in(_size(path))
    finally:
        os.close(fd)


def _verified(fd: int, layout: RecordLayout, slot: int, header: bytes) -> bool:
    """Whether slot ``slot`` holds a complete record that passes every check a read makes."""
    key = header[_KEY_AT:_KEY_AT + 32]
    payload = os.pread(fd, layout.page_bytes, layout.payload_at(slot))
    if len(payload) != layout.page_bytes:
        return False
    view = memoryview(payload)
    if layout.verify(header, slot, key, view, check_payload=True) is not Verdict.OK:
        return False
    for chunk in range(layout.chunks):  # partial reads trust the chunk table: check it too
        piece = view[chunk * layout.chunk_bytes:(chunk + 1) * layout.chunk_bytes]
        stored: int = struct.unpack_from("<Q", header, HEADER_BYTES + 8 * chunk)[0]
        if xxhash.xxh3_64_intdigest(piece) != stored:
            return False
    return True


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
