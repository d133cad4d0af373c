"""A ``file://`` store whose index (HEAD, journal, snapshot) was deleted rebuilds it from the
segments' record headers: every intact page reads back byte for byte, damaged records are
skipped and counted (never served), a fresh directory never rebuilds, new segment ids never name
a scanned segment, and a rebuild cut short (a torn append, a kill -9 midway) is finished by
the next opening."""

from __future__ import annotations

import logging
import os
import signal
import struct
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import pytest

from kvtier.store import open_store
from kvtier.store.file import FileStore
from kvtier.store.file.index import REBUILD_BEGIN, REBUILD_DONE, PageIndex, split
from kvtier.store.file.journal import ENTRY_BYTES, OP_SEGMENT, decode_entries
from kvtier.store.file.segment import list_segments, segment_path
from store_contract import key_for, page_bytes_for

PAGE = 8192
PAGES = 60
SEGMENT = "64KiB"  # a few pages per segment: the pages span several segment files


def open_file(root: Path, **options: object) -> FileStore:
    store = open_store(f"file://{root}", page_bytes=PAGE, segment_bytes=SEGMENT, **options)
    assert isinstance(store, FileStore)
    return store


def fill(store: FileStore, indexes: range) -> None:
    keys = [key_for(i) for i in indexes]
    assert store.write(keys, [page_bytes_for(i, PAGE) for i in indexes]) == [True] * len(keys)


def served(store: FileStore, indexes: range) -> list[bool]:
    """Which pages are served; every page served must be the very bytes written."""
    keys = [key_for(i) for i in indexes]
    buffers = [bytearray(PAGE) for _ in keys]
    found = store.read_into(keys, buffers)
    for i, buf, ok in zip(indexes, buffers, found, strict=True):
        assert not ok or bytes(buf) == page_bytes_for(i, PAGE), f"page {i} served wrong"
    return found


def delete_index(root: Path) -> None:
    doomed = [root / "HEAD", *root.glob("journal.*"), *root.glob("snapshot.*")]
    assert any(p.exists() for p in doomed)
    for path in doomed:
        path.unlink(missing_ok=True)


def written_store(root: Path) -> dict[int, tuple[int, int]]:
    """A closed store of ``PAGES`` pages; page -> (segment, slot)."""
    store = open_file(root)
    fill(store, range(PAGES))
    where = {i: split(store.index.where[key_for(i)]) for i in range(PAGES)}
    store.close()
    assert len({seg for seg, _ in where.values()}) > 2
    return where


def journal_markers(root: Path) -> list[int]:
    data = (root / "journal.0").read_bytes()
    return [e.value for e in decode_entries(data)
            if e is not None and e.op == OP_SEGMENT and e.value in (REBUILD_BEGIN, REBUILD_DONE)]


def rebuild_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "rebuilt it" in r.getMessage()]


def test_every_page_reads_back_after_the_index_is_deleted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    written_store(tmp_path)
    delete_index(tmp_path)
    with caplog.at_level(logging.WARNING):
        store = open_file(tmp_path)
    assert served(store, range(PAGES)) == [True] * PAGES
    stats = store.stats()
    assert (stats.pages, stats.recovered, stats.recovery_skipped) == (PAGES, PAGES, 0)
    warnings = rebuild_warnings(caplog)
    assert len(warnings) == 1 and f"{PAGES} pages recovered, 0 records skipped" in warnings[0]
    store.close()
    assert journal_markers(tmp_path) == [REBUILD_BEGIN, REBUILD_DONE]


def test_damaged_records_are_skipped_counted_and_never_served(tmp_path: Path) -> None:
    where = written_store(tmp_path)
    probe = open_file(tmp_path)
    layout = probe.layout
    probe.close()
    flipped = 7
    seg, slot = where[flipped]
    with open(segment_path(tmp_path / "segments", seg), "r+b") as f:  # one bit of the payload
        f.seek(layout.payload_at(slot) + 100)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))
    last = max(range(PAGES), key=lambda i: where[i])  # the newest record: cut its tail
    seg, slot = where[last]
    os.truncate(segment_path(tmp_path / "segments", seg), layout.payload_at(slot) + PAGE // 2)
    delete_index(tmp_path)

    store = open_file(tmp_path)
    found = served(store, range(PAGES))
    assert [i for i, ok in enumerate(found) if not ok] == [flipped, last]
    stats = store.stats()
    assert (stats.recovered, stats.recovery_skipped) == (PAGES - 2, 2)
    assert store.contains([key_for(flipped), key_for(last)]) == [False, False]
    store.close()


def test_a_record_of_another_format_version_is_skipped(tmp_path: Path) -> None:
    where = written_store(tmp_path)
    seg, slot = where[3]
    path = segment_path(tmp_path / "segments", seg)
    probe = open_file(tmp_path)
    at = probe.layout.header_at(slot)
    probe.close()
    with open(path, "r+b") as f:  # version 2, with a crc that holds: intact, but not ours
        f.seek(at)
        header = bytearray(f.read(64))
        struct.pack_into("<H", header, 4, 2)
        struct.pack_into("<I", header, 60, zlib.crc32(bytes(header[:60])))
        f.seek(at)
        f.write(header)
    delete_index(tmp_path)
    store = open_file(tmp_path)
    assert [i for i, ok in enumerate(served(store, range(PAGES))) if not ok] == [3]
    assert store.stats().recovery_skipped == 1
    store.close()


def test_a_fresh_or_intact_directory_never_rebuilds(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        store = open_file(tmp_path)  # fresh: no segments, an empty journal
        assert store.stats().recovered == 0
        store.close()
        store = open_file(tmp_path)  # the manifest and an empty journal only
        fill(store, range(PAGES))
        store.close()
        store = open_file(tmp_path)  # intact
        assert served(store, range(PAGES)) == [True] * PAGES
        assert store.stats().recovered == 0
        store.close()
    assert rebuild_warnings(caplog) == []
    assert journal_markers(tmp_path) == []


def test_writes_after_a_rebuild_get_new_segment_ids_and_survive_reopening(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    where = written_store(tmp_path)
    scanned = set(list_segments(tmp_path / "segments"))
    os.truncate(segment_path(tmp_path / "segments", max(scanned)), 0)  # no record left in it
    lost = {i for i, (seg, _) in where.items() if seg == max(scanned)}
    delete_index(tmp_path)
    store = open_file(tmp_path)
    replayed = PageIndex()  # what any process learns from the journal alone
    for entry in decode_entries((tmp_path / "journal.0").read_bytes()):
        assert entry is not None
        replayed.apply(entry)
    assert replayed.max_seg >= max(scanned)
    fill(store, range(PAGES, 2 * PAGES))
    new = {split(store.index.where[key_for(i)])[0] for i in range(PAGES, 2 * PAGES)}
    assert min(new) > max(scanned), (sorted(scanned), sorted(new))
    store.close()

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        store = open_file(tmp_path)
    assert served(store, range(2 * PAGES)) == [i not in lost for i in range(2 * PAGES)]
    assert store.stats().recovered == 0  # rebuilt once: this opening only loads the journal
    assert rebuild_warnings(caplog) == []
    store.close()


@pytest.mark.parametrize("cut", [1, 20, ENTRY_BYTES * 3 + 17])
def test_a_rebuild_cut_short_is_finished_by_the_next_opening(tmp_path: Path, cut: int) -> None:
    """The rebuild's journal append cut after ``cut`` bytes (a kill -9 or power loss midway)."""
    written_store(tmp_path)
    delete_index(tmp_path)
    open_file(tmp_path).close()
    journal = tmp_path / "journal.0"
    os.truncate(journal, min(cut * ENTRY_BYTES if cut < 64 else cut, journal.stat().st_size - 1))
    store = open_file(tmp_path)
    assert served(store, range(PAGES)) == [True] * PAGES
    store.close()
    assert journal_markers(tmp_path)[-1] == REBUILD_DONE
    store = open_file(tmp_path)  # and nothing left to finish
    assert store.stats().recovered == 0
    assert served(store, range(PAGES)) == [True] * PAGES
    store.close()


def test_handles_opening_a_lost_index_at_once_rebuild_it_once(tmp_path: Path) -> None:
    written_store(tmp_path)
    delete_index(tmp_path)
    stores: list[FileStore] = []
    start = threading.Barrier(3)

    def opener() -> None:
        start.wait()
        stores.append(open_file(tmp_path))

    threads = [threading.Thread(target=opener) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(s.stats().recovered for s in stores) == [0, 0, PAGES]
    for store in stores:
        assert served(store, range(PAGES)) == [True] * PAGES
        store.close()
    assert journal_markers(tmp_path) == [REBUILD_BEGIN, REBUILD_DONE]


#: A process that rebuilds the index and is killed (SIGKILL) halfway through the rebuild's
#: journal append: half of its entries reach the journal, then the process dies.
_KILLED_REBUILD = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from kvtier.store.file.journal import Journal
from kvtier.store.file.store import FileStore
def half_then_die(self, encoded):
    os.write(self.fd, b"".join(encoded[:len(encoded) // 2]))
    os.kill(os.getpid(), signal.SIGKILL)
Journal._write_locked = half_then_die
FileStore(sys.argv[2], int(sys.argv[3]), None)
"""


def test_a_rebuild_killed_midway_is_finished_by_the_next_opening(tmp_path: Path) -> None:
    written_store(tmp_path)
    delete_index(tmp_path)
    src = str(Path(__file__).resolve().parents[3] / "src")
    proc = subprocess.run([sys.executable, "-c", _KILLED_REBUILD, src, str(tmp_path), str(PAGE)],
                          timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert journal_markers(tmp_path) == [REBUILD_BEGIN]  # begun, not finished
    store = open_file(tmp_path)
    assert served(store, range(PAGES)) == [True] * PAGES
    assert store.stats().recovered == PAGES
    store.close()
    assert journal_markers(tmp_path) == [REBUILD_BEGIN, REBUILD_DONE]
