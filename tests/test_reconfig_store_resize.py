"""Store caps changed at run time: shrinks evict down to the cap, never under a read or a write."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.store.file import FileStore
from kvtier.store.file.options import FileStoreOptions
from kvtier.store.memory import MemoryStore

PAGE = 512


def page(i: int) -> bytes:
    return bytes([i % 251]) * PAGE


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def small_segments(tmp_path: Path) -> FileStore:
    """Eight records per segment, so a few pages spread over several segments."""
    return FileStore(tmp_path / "store", PAGE, FileStoreOptions(segment_bytes=8 * 576))


def fill(store: FileStore, lo: int, hi: int) -> None:
    for start in range(lo, hi, 8):
        keys = [key(i) for i in range(start, min(hi, start + 8))]
        assert store.write(keys, [page(i) for i in range(start, start + len(keys))]) == \
            [True] * len(keys)
    store.writer.seal_all()


def test_file_shrink_evicts_oldest_segments_until_the_cap_holds(tmp_path: Path) -> None:
    store = small_segments(tmp_path)
    fill(store, 0, 32)
    record = store.layout.record_bytes
    result = store.resize(16 * record)
    assert result["fits"] and result["segment_bytes_after"] <= 16 * record
    assert store.contains([key(i) for i in range(32)]) == [False] * 16 + [True] * 16
    assert store.options.max_bytes == 16 * record
    buffer = bytearray(PAGE)
    assert store.read_into([key(31)], [buffer]) == [True] and bytes(buffer) == page(31)
    store.close()


def test_file_shrink_waits_for_a_read_in_progress_which_gets_intact_bytes(tmp_path: Path,
                                                                        monkeypatch) -> None:
    store = small_segments(tmp_path)
    fill(store, 0, 16)
    entered, gate = threading.Event(), threading.Event()
    real_read = store.io.read_many

    def slow_read(*args):  # type: ignore[no-untyped-def]
        entered.set()
        gate.wait(10)
        return real_read(*args)

    monkeypatch.setattr(store.io, "read_many", slow_read)
    buffers = [bytearray(PAGE) for _ in range(8)]
    found: list[bool] = []
    reader = threading.Thread(target=lambda: found.extend(
        store.read_into([key(i) for i in range(8)], buffers)))
    reader.start()
    assert entered.wait(5)
    result = store.resize(1, wait_s=0.3)  # the oldest segment is being read: it stays
    assert not result["fits"]
    assert store.contains([key(0)]) == [True] and store.contains([key(8)]) == [False]
    gate.set()
    reader.join(10)
    assert found == [True] * 8 and [bytes(b) for b in buffers] == [page(i) for i in range(8)]
    assert store.resize(1)["fits"]  # the read is over: now it goes
    store.close()


def test_file_shrink_never_evicts_a_segment_being_written(tmp_path: Path, monkeypatch) -> None:
    store = small_segments(tmp_path)
    fill(store, 0, 16)
    entered, gate = threading.Event(), threading.Event()
    real_write = store.io.write

    def slow_write(fd, direct_fd, slot, page_key, view):  # type: ignore[no-untyped-def]
        if page_key == key(99):
            entered.set()
            gate.wait(10)
        return real_write(fd, direct_fd, slot, page_key, view)

    monkeypatch.setattr(store.io, "write", slow_write)
    written: list[bool] = []

    def write_then_write_more() -> None:  # one segment: four pages land, a fifth is in flight
        written.extend(store.write([key(i) for i in range(20, 24)], [page(i) for i in range(4)]))
        written.extend(store.write([key(99)], [page(99)]))

    writer = threading.Thread(target=write_then_write_more)
    writer.start()
    assert entered.wait(5)
    shrink = threading.Thread(target=store.resize, args=(1,))
    shrink.start()
    shrink.join(0.3)
    assert shrink.is_alive(), "the shrink gave up or evicted a segment being written"
    assert store.contains([key(i) for i in range(16)]) == [False] * 16  # idle ones went
    assert store.contains([key(i) for i in range(20, 24)]) == [True] * 4  # this one stays
    gate.set()
    writer.join(10)
    shrink.join(10)
    assert written == [True] * 5
    assert store.disk_usage()["segment_bytes"] <= 1  # once the write landed, it went too
    store.close()


def test_file_clear_deletes_every_page_and_frees_the_segments(tmp_path: Path) -> None:
    store = small_segments(tmp_path)
    fill(store, 0, 20)
    assert store.clear() == 20
    assert store.stats().pages == 0 and store.disk_usage()["segment_bytes"] == 0
    reopened = FileStore(tmp_path / "store", PAGE)
    assert reopened.contains([key(i) for i in range(20)]) == [False] * 20
    reopened.close()
    store.close()


def test_memory_shrink_drops_least_recently_used_pages_first() -> None:
    store = MemoryStore(PAGE)
    store.write([key(i) for i in range(10)], [page(i) for i in range(10)])
    store.read_into([key(0)], [bytearray(PAGE)])  # page 0 is now the most recent
    store.resize(4 * PAGE)
    assert store.contains([key(i) for i in range(10)]) == \
        [True] + [False] * 6 + [True] * 3
    assert store.stats().evicted == 6 and store.stats().capacity_bytes == 4 * PAGE
    with pytest.raises(ConfigError):
        store.resize(PAGE - 1)
