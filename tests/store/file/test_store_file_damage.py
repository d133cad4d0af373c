"""File store damage: a page that fails verification is a miss once, leaves every index (this
handle's, other processes', the journal a restart reads) and is stored again by the next write;
a segment left without live pages is freed."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from kvtier.store import open_store
from kvtier.store.file import FileStore
from kvtier.store.file.index import split
from kvtier.store.file.segment import segment_path
from store_contract import key_for, page_bytes_for

PAGE = 4096


def _open(path: Path) -> FileStore:
    store = open_store(f"file://{path}", page_bytes=PAGE)
    assert isinstance(store, FileStore)
    return store


def _fill(store: FileStore, indexes: range) -> None:
    pages = [page_bytes_for(i, PAGE) for i in indexes]
    assert store.write([key_for(i) for i in indexes], pages) == [True] * len(pages)


def _read(store: FileStore, indexes: range) -> list[bool]:
    out = [np.zeros(PAGE, np.uint8) for _ in indexes]
    found = store.read_into([key_for(i) for i in indexes], out)
    for i, ok, page in zip(indexes, found, out, strict=True):
        assert not ok or page.tobytes() == page_bytes_for(i, PAGE)
    return found


def _flip_payload(store: FileStore, i: int) -> None:
    seg, slot = split(store.index.where[key_for(i)])
    with open(segment_path(store.segments_dir, seg), "r+b") as f:
        f.seek(store.layout.payload_at(slot) + 7)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))


def test_corrupt_page_is_a_miss_once_then_stored_again(tmp_path: Path) -> None:
    store = _open(tmp_path)
    other = _open(tmp_path)  # another process sharing the directory
    _fill(store, range(4))
    _flip_payload(store, 2)
    assert _read(store, range(4)) == [True, True, False, True]
    assert _read(store, range(4)) == [True, True, False, True]
    stats = store.stats()
    assert (stats.corrupt, stats.dropped) == (1, 1)  # rejected once, then not there at all
    assert store.contains([key_for(2)]) == [False]
    assert other.contains([key_for(i) for i in range(4)]) == [True, True, False, True]
    _fill(store, range(2, 3))  # the next write stores a good copy
    assert _read(store, range(4)) == [True] * 4
    assert _read(other, range(4)) == [True] * 4
    store.close()
    other.close()


def test_truncated_segment_stays_dropped_after_a_restart_and_is_freed(tmp_path: Path) -> None:
    store = _open(tmp_path)
    _fill(store, range(6))
    seg, slot = split(store.index.where[key_for(3)])
    store.close()
    os.truncate(segment_path(tmp_path / "segments", seg), store.layout.payload_at(slot) + 10)
    store = _open(tmp_path)
    assert _read(store, range(6)) == [True, True, True, False, False, False]
    assert store.stats().dropped == 3
    store.close()
    store = _open(tmp_path)  # a restart reads the journal: the torn pages stay gone
    assert store.contains([key_for(i) for i in range(6)]) == [True] * 3 + [False] * 3
    _fill(store, range(3, 6))
    assert _read(store, range(6)) == [True] * 6
    store.close()
    # all pages of a segment damaged: nothing live stays in it, its file goes
    store = _open(tmp_path)
    seg = split(store.index.where[key_for(3)])[0]
    assert all(split(store.index.where[key_for(i)])[0] != seg for i in range(3))
    store.close()
    os.truncate(segment_path(tmp_path / "segments", seg), 0)
    store = _open(tmp_path)
    assert _read(store, range(3, 6)) == [False] * 3
    assert not segment_path(tmp_path / "segments", seg).exists()
    assert seg not in store.index.seg_slots
    store.close()


def test_a_good_copy_stored_meanwhile_is_not_dropped(tmp_path: Path) -> None:
    store = _open(tmp_path)
    _fill(store, range(2))
    stale = store.index.where[key_for(1)]
    _fill(store, range(1, 2))  # another writer stored the page again, elsewhere
    assert store.damage.drop([key_for(1)], [stale], [False], 0) == 0
    assert _read(store, range(2)) == [True, True]
    assert store.stats().dropped == 0
    store.close()
