"""File-store capacity: the byte cap and free-space watermark evict oldest segments first, pages
read since written get reinserted, a page being read is never evicted under its reader, and a
full filesystem refuses writes while reads go on."""

from __future__ import annotations

import errno
import os
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

from kvtier.store import open_store
from kvtier.store.file import FileStore
from kvtier.store.file.segment import RecordLayout
from store_contract import key_for, page_bytes_for

PAGE = 4096
RECORD = RecordLayout.plan(PAGE, 1 << 20, None).record_bytes  # disk bytes per page
SEGMENT = 4 * RECORD


def _open(path: Path, query: str = "") -> FileStore:
    store = open_store(f"file://{path}{query}", page_bytes=PAGE)
    assert isinstance(store, FileStore)
    return store


def _write(store: FileStore, indexes: range) -> list[bool]:
    return store.write([key_for(i) for i in indexes], [page_bytes_for(i, PAGE) for i in indexes])


def _read(store: FileStore, i: int) -> bytes | None:
    out = np.zeros(PAGE, np.uint8)
    return out.tobytes() if store.read_into([key_for(i)], [out]) == [True] else None


# ---- caps --------------------------------------------------------------------------------


def test_cap_evicts_oldest_segments_first_and_holds(tmp_path: Path) -> None:
    store = _open(tmp_path, f"?max_bytes={16 * SEGMENT}&segment_bytes={SEGMENT}")
    for i in range(100):
        assert _write(store, range(i, i + 1)) == [True]
    assert store.disk_usage()["segment_bytes"] <= 16 * SEGMENT
    present = store.contains([key_for(i) for i in range(100)])
    assert not any(present[:30]) and all(present[-48:])
    assert store.stats().evicted == 100 - store.stats().pages
    store.close()


def test_page_read_since_written_is_reinserted_and_survives(tmp_path: Path) -> None:
    store = _open(tmp_path, f"?max_bytes={16 * SEGMENT}&segment_bytes={SEGMENT}")
    _write(store, range(4))  # the first segment
    assert _read(store, 1) is not None  # page 1 is now hot
    _write(store, range(4, 72))  # forces the first segment out
    assert store.contains([key_for(i) for i in range(4)]) == [False, True, False, False]
    assert _read(store, 1) == page_bytes_for(1, PAGE)
    store.close()


def test_gc_evicts_down_to_the_target(tmp_path: Path) -> None:
    store = _open(tmp_path, f"?segment_bytes={SEGMENT}")
    _write(store, range(40))
    store.writer.close()  # seal the open segment so that everything is evictable
    dropped = store.evictor.gc(3 * SEGMENT)
    assert store.disk_usage()["segment_bytes"] <= 3 * SEGMENT
    assert dropped == 40 - store.stats().pages and store.stats().pages <= 12
    store.close()


def test_free_space_watermark_refuses_what_cannot_fit(tmp_path: Path) -> None:
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    store = _open(tmp_path, f"?min_free_bytes={free + (1 << 40)}")
    assert _write(store, range(3)) == [False] * 3
    assert store.stats().refused == 3 and store.stats().pages == 0
    store.close()


def test_page_being_read_is_not_evicted_under_its_reader(tmp_path: Path, monkeypatch) -> None:
    store = _open(tmp_path, f"?max_bytes={16 * SEGMENT}&segment_bytes={SEGMENT}")
    _write(store, range(4))
    real_preadv = os.preadv
    in_read, go_on = threading.Event(), threading.Event()

    def slow_preadv(fd, buffers, offset):  # the reader stalls after pinning, before reading
        if threading.current_thread().name == "reader" and not in_read.is_set():
            in_read.set()
            assert go_on.wait(10)
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", slow_preadv)
    got: list[bytes | None] = []
    reader = threading.Thread(target=lambda: got.append(_read(store, 0)), name="reader")
    reader.start()
    assert in_read.wait(10)
    _write(store, range(4, 72))  # evicts the segment the reader holds
    assert store.contains([key_for(0)]) == [False]
    assert not list(tmp_path.glob("segments/0000000000.seg"))  # its file is gone
    go_on.set()
    reader.join(10)
    assert got == [page_bytes_for(0, PAGE)]
    store.close()


# ---- full filesystem ---------------------------------------------------------------------


def _check_full_disk_behaviour(store: FileStore, pages: int) -> None:
    """Write until refused; reads go on; after the evictor frees a segment, writes go on."""
    results = [_write(store, range(i, i + 1))[0] for i in range(pages)]
    assert not all(results), "the filesystem never filled"
    first_refusal = results.index(False)
    stats = store.stats()
    assert stats.refused >= 1 and stats.errors >= 1
    readable = [i for i in range(pages) if results[i] and store.contains([key_for(i)])[0]]
    assert readable and all(_read(store, i) == page_bytes_for(i, PAGE) for i in readable)
    assert any(results[first_refusal + 1:]), "writes never resumed after eviction freed space"
    assert store.stats().corrupt == 0


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """A 1 MiB tmpfs, where mounting works (root); skipped elsewhere."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; the injected-ENOSPC test covers this")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                          capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_tmpfs_refuses_writes_and_keeps_serving_reads(small_tmpfs: Path) -> None:
    store = _open(small_tmpfs, f"?segment_bytes={SEGMENT}")
    _check_full_disk_behaviour(store, 400)
    store.close()


def test_injected_enospc_refuses_writes_and_keeps_serving_reads(tmp_path: Path,
                                                                 monkeypatch) -> None:
    """The same behaviour through injected faults: record writes and journal appends fail with
    ENOSPC once the store's segment files pass 1 MiB, as on a full filesystem."""
    store = _open(tmp_path, f"?segment_bytes={SEGMENT}")
    real_pwritev, real_write = os.pwritev, os.write

    def full() -> bool:
        return store.index.used_slots() * RECORD >= (1 << 20)

    def pwritev(fd, buffers, offset):
        if full():
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real_pwritev(fd, buffers, offset)

    def write(fd, data):
        if full() and fd == store.journal.fd:
            half = len(data) // 2  # a short append, which must be rolled back
            return real_write(fd, data[:half]) if half else 0
        return real_write(fd, data)

    monkeypatch.setattr(os, "pwritev", pwritev)
    monkeypatch.setattr(os, "write", write)
    _check_full_disk_behaviour(store, 400)
    assert os.fstat(store.journal.fd).st_size % 64 == 0
    store.close()
    monkeypatch.undo()
    assert _open(tmp_path).stats().corrupt == 0


def test_enospc_during_reinsertion_neither_deadlocks_nor_loses_acknowledged_pages(
        tmp_path: Path, monkeypatch) -> None:
    """The evictor copies hot pages forward while it holds its lock; when those copies hit
    ENOSPC, the write error handler must not wait for that same lock (it asks the evictor to
    free space), and the pages that stay indexed must read back intact."""
    store = _open(tmp_path, f"?max_bytes={16 * SEGMENT}&segment_bytes={SEGMENT}")
    assert all(_write(store, range(64)))  # 16 full segments: the cap
    assert all(_read(store, i) == page_bytes_for(i, PAGE) for i in range(4))  # all hot
    real_pwritev = os.pwritev
    failed: list[int] = []

    def pwritev(fd, buffers, offset):  # the disk is full for the evictor's copies only
        if getattr(store.evictor._inside, "active", False):
            failed.append(fd)
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    result: list[list[bool]] = []
    writer = threading.Thread(target=lambda: result.append(_write(store, range(64, 68))),
                              daemon=True)
    writer.start()
    writer.join(20)
    assert not writer.is_alive(), "a write deadlocked on ENOSPC during reinsertion"
    assert failed, "the reinsertion never wrote (the test did not exercise the fault)"
    assert result == [[True] * 4]  # the victim's unlink made room all the same
    present = store.contains([key_for(i) for i in range(68)])
    assert present[4:] == [True] * 64  # only the victim segment's pages may go
    kept = [i for i in range(68) if present[i]]
    assert all(_read(store, i) == page_bytes_for(i, PAGE) for i in kept)
    stats = store.stats()
    assert stats.corrupt == 0 and stats.pages == len(kept) and stats.evicted == 68 - len(kept)
    store.close()
    monkeypatch.undo()
    reopened = _open(tmp_path)
    assert reopened.contains([key_for(i) for i in range(68)]) == present
    assert all(_read(reopened, i) == page_bytes_for(i, PAGE) for i in kept)
    reopened.close()
