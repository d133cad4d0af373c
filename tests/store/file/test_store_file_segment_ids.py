"""Segment ids of a ``file://`` store are never reused: not after ``clear()``, a journal
compaction to an empty snapshot and a restart, and not by a handle whose view is stale."""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.store import open_store
from kvtier.store.file import FileStore
from kvtier.store.file.index import split
from kvtier.store.file.segment import list_segments
from store_contract import key_for, page_bytes_for

PAGE = 512
BATCH = 500


def open_file(root: Path, **options: object) -> FileStore:
    store = open_store(f"file://{root}", page_bytes=PAGE, **options)
    assert isinstance(store, FileStore)
    return store


def fill(store: FileStore, first: int, count: int) -> None:
    page = page_bytes_for(first, PAGE)
    for start in range(first, first + count, BATCH):
        keys = [key_for(i) for i in range(start, min(start + BATCH, first + count))]
        assert store.write(keys, [page] * len(keys)) == [True] * len(keys)


def readable(store: FileStore, first: int, count: int) -> int:
    keys = [key_for(i) for i in range(first, first + count)]
    buffers = [bytearray(PAGE) for _ in keys]
    found = store.read_into(keys, buffers)
    assert all(bytes(b) == page_bytes_for(first, PAGE) for b, ok in zip(buffers, found, strict=True) if ok)
    return sum(found)


def segment_ids(store: FileStore) -> set[int]:
    return {split(loc)[0] for loc in store.index.where.values()}


def test_pages_written_after_clear_and_restart_read_back(tmp_path: Path) -> None:
    """40,000 pages of 512 B in 4 MiB segments: clear() compacts the journal to an empty
    snapshot; after a restart 10,000 new pages must read back, then and after reopening."""
    root = tmp_path / "store"
    store = open_file(root, segment_bytes="4MiB")
    fill(store, 0, 40_000)
    old_ids = segment_ids(store)
    assert store.clear() == 40_000
    store.close()

    store = open_file(root)
    fill(store, 100_000, 10_000)
    assert sum(store.contains([key_for(i) for i in range(100_000, 110_000)])) == 10_000
    assert readable(store, 100_000, 10_000) == 10_000
    new_ids = segment_ids(store)
    store.close()
    assert min(new_ids) > max(old_ids), (sorted(old_ids), sorted(new_ids))

    store = open_file(root)
    try:
        assert readable(store, 100_000, 10_000) == 10_000
    finally:
        store.close()


def test_segment_ids_keep_rising_across_compactions_of_an_empty_store(tmp_path: Path,
                                                                       monkeypatch) -> None:
    """Each round: fill, clear (evicting every segment; with no lower bound the journal
    compacts after each evict entry, so the last snapshot is empty and names no segment),
    reopen. The ids handed out must keep rising from round to round."""
    import kvtier.store.file.store as file_module

    monkeypatch.setattr(file_module, "COMPACT_MIN_ENTRIES", 0)
    root = tmp_path / "store"
    highest = -1
    for round_ in range(3):
        store = open_file(root, segment_bytes="8KiB")
        fill(store, 1000 * round_, 100)
        ids = segment_ids(store)
        assert min(ids) > highest, (round_, sorted(ids), highest)
        assert readable(store, 1000 * round_, 100) == 100
        highest = max(ids)
        store.clear()
        assert list_segments(store.segments_dir) == {}
        store.close()


def test_a_handle_with_a_stale_view_never_reuses_an_id_another_handle_evicted(
        tmp_path: Path) -> None:
    """Handle A sits idle while handle B (as another process would) fills and clears the
    store; A's next segment must not take an id B used, and its pages must read back."""
    root = tmp_path / "store"
    idle = open_file(root, segment_bytes="8KiB")
    busy = open_file(root)
    try:
        fill(busy, 0, 200)
        used_by_busy = segment_ids(busy)
        busy.clear()
        fill(idle, 10_000, 50)
        assert not segment_ids(idle) & used_by_busy
        assert readable(idle, 10_000, 50) == 50
        assert readable(busy, 10_000, 50) == 50
    finally:
        idle.close()
        busy.close()


def test_an_evicted_segment_is_forgotten_once_its_last_reader_lets_go(tmp_path: Path) -> None:
    """Retiring a segment closes its descriptor after the last pin; nothing else is kept, so
    a later segment file under that name (written by a store of an older version, which could
    reuse ids) is read rather than refused forever."""
    from kvtier.store.file.segment import segment_path
    from kvtier.store.file.segment_files import SegmentReaders

    directory = tmp_path / "segments"
    directory.mkdir()
    segment_path(directory, 3).write_bytes(b"old")
    readers = SegmentReaders(directory)
    fd = readers.pin(3)
    assert fd is not None
    readers.retire(3)
    assert readers.pin(3) is None  # evicted: no new reader while the old one holds it
    assert readers.pinned(3)
    readers.unpin(3)
    assert not readers.pinned(3)
    segment_path(directory, 3).unlink()
    segment_path(directory, 3).write_bytes(b"new")
    fd = readers.pin(3)
    assert fd is not None and os.pread(fd, 3, 0) == b"new"
    readers.unpin(3)
    readers.close()
