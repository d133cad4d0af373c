"""File store records: corruption reads as a counted miss, partial reads verify their chunks,
the journal compacts and recovers, crash leftovers are cleaned, options are checked."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

import kvtier.store.file.store as file_module
from kvtier.errors import ConfigError, LayoutMismatch
from kvtier.layout import ByteRange
from kvtier.store import open_store
from kvtier.store.file import FileStore
from kvtier.store.file.index import split
from kvtier.store.file.journal import OP_PUT, decode_entries
from kvtier.store.file.segment import segment_path
from store_contract import key_for, page_bytes_for

PAGE = 4096
BIG = 4 * 65536  # four chunks: records carry a chunk table


def _open(path: Path, page: int = PAGE, query: str = "") -> FileStore:
    store = open_store(f"file://{path}{query}", page_bytes=page)
    assert isinstance(store, FileStore)
    return store


def _fill(store: FileStore, indexes: range) -> None:
    pages = [page_bytes_for(i, store.page_bytes) for i in indexes]
    assert store.write([key_for(i) for i in indexes], pages) == [True] * len(pages)


def _put_entry_at(journal: bytes, i: int) -> int:
    """Byte offset of the (first) put entry of page ``i`` in a journal's bytes."""
    entries = list(decode_entries(journal))
    return 64 * next(n for n, e in enumerate(entries)
                     if e is not None and e.op == OP_PUT and e.key == key_for(i))


def _read(store: FileStore, i: int) -> bytes | None:
    out = np.zeros(store.page_bytes, np.uint8)
    return out.tobytes() if store.read_into([key_for(i)], [out]) == [True] else None


def _flip(store: FileStore, i: int, offset: int, in_header: bool = False) -> None:
    """Flip one byte of page ``i``'s payload (or of its header) on disk."""
    seg, slot = split(store.index.where[key_for(i)])
    layout = store.layout
    with open(segment_path(store.segments_dir, seg), "r+b") as f:
        f.seek((layout.header_at(slot) if in_header else layout.payload_at(slot)) + offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))


# ---- corruption --------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["payload_start", "payload_end", "header_key", "header_crc"])
def test_flipped_byte_reads_as_a_counted_corrupt_miss(tmp_path: Path, where: str) -> None:
    store = _open(tmp_path)
    _fill(store, range(4))
    offsets = {"payload_start": (0, False), "payload_end": (PAGE - 1, False),
               "header_key": (40, True), "header_crc": (61, True)}
    _flip(store, 2, *offsets[where])
    assert [_read(store, i) is not None for i in range(4)] == [True, True, False, True]
    stats = store.stats()
    assert (stats.corrupt, stats.misses, stats.hits) == (1, 1, 3)
    store.close()


def test_record_of_another_key_reads_as_a_miss(tmp_path: Path) -> None:
    store = _open(tmp_path)
    _fill(store, range(2))
    store.index.where[key_for(0)] = store.index.where[key_for(1)]  # a stale index entry
    assert _read(store, 0) is None and store.stats().corrupt == 1
    store.close()


def test_header_only_verification_skips_the_payload_but_not_the_header(tmp_path: Path) -> None:
    store = _open(tmp_path, query="?verify=header")
    _fill(store, range(2))
    _flip(store, 0, 7)
    _flip(store, 1, 40, in_header=True)
    assert _read(store, 0) is not None and _read(store, 1) is None
    store.close()


# ---- partial reads -----------------------------------------------------------------------


def test_partial_read_checks_only_the_chunks_it_reads(tmp_path: Path) -> None:
    store = _open(tmp_path, BIG)
    _fill(store, range(1))
    page = page_bytes_for(0, BIG)
    ranges = [ByteRange(65536 + 10, 100), ByteRange(2 * 65536, 5)]
    _flip(store, 0, 3 * 65536 + 1)  # in chunk 3, not read
    out = np.zeros(105, np.uint8)
    assert store.read_ranges_into([key_for(0)], ranges, [out]) == [True]
    assert out.tobytes() == page[65546:65646] + page[131072:131077]
    assert _read(store, 0) is None  # the whole-page read sees the damage (and drops it)
    _fill(store, range(1))  # a good copy again
    _flip(store, 0, 65536 + 50)  # in chunk 1, read
    assert store.read_ranges_into([key_for(0)], ranges, [out]) == [False]
    store.close()


def test_ranges_outside_the_page_are_misuse(tmp_path: Path) -> None:
    store = _open(tmp_path, BIG)
    with pytest.raises(ValueError):
        store.read_ranges_into([key_for(0)], [ByteRange(BIG - 2, 4)], [bytearray(4)])
    store.close()


# ---- journal -----------------------------------------------------------------------------


def test_journal_compacts_and_reopens_with_the_same_pages(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(file_module, "COMPACT_MIN_ENTRIES", 16)
    store = _open(tmp_path)
    for i in range(150):
        _fill(store, range(i % 5, i % 5 + 1))
    _fill(store, range(100, 110))
    store.delete([key_for(101)])
    assert store.journal.gen >= 2
    follower = _open(tmp_path)  # a second handle follows the seals from the snapshot on
    _fill(store, range(200, 260))
    assert _read(follower, 259) == page_bytes_for(259, PAGE)
    store.close()
    follower.close()
    reopened = _open(tmp_path)
    expected = {i for i in range(5)} | set(range(100, 110)) - {101} | set(range(200, 260))
    assert reopened.stats().pages == len(expected)
    assert all(_read(reopened, i) == page_bytes_for(i, PAGE) for i in expected)
    assert sorted(p.name for p in tmp_path.glob("journal.*"))[-1] == f"journal.{reopened.journal.gen}"
    reopened.close()


def test_torn_journal_tail_is_cut_and_bad_entries_are_skipped(tmp_path: Path) -> None:
    store = _open(tmp_path)
    _fill(store, range(3))
    store.close()
    journal = tmp_path / "journal.0"
    data = bytearray(journal.read_bytes())
    data[_put_entry_at(data, 1) + 20] ^= 0xFF  # damage the put of page 1
    journal.write_bytes(bytes(data) + b"\x01" * 17)  # and a torn partial entry
    store = _open(tmp_path)
    assert store.contains([key_for(i) for i in range(3)]) == [True, False, True]
    assert journal.stat().st_size % 64 == 0 and store.journal.bad_entries == 1
    _fill(store, range(3, 4))
    store.close()
    assert _open(tmp_path).contains([key_for(3)]) == [True]


def test_record_written_but_never_journaled_stays_invisible(tmp_path: Path) -> None:
    store = _open(tmp_path)
    _fill(store, range(2))
    slots = store.writer.reserve(1)  # what a writer killed before publishing leaves behind
    store.io.write(slots[0].fd, None, slots[0].slot, key_for(7),
                   memoryview(page_bytes_for(7, PAGE)))
    store.close()
    reopened = _open(tmp_path)
    assert reopened.contains([key_for(7), key_for(1)]) == [False, True]
    reopened.close()


# ---- leftovers, layout, options ------------------------------------------------------------


def test_open_removes_old_temp_files_and_dead_segments(tmp_path: Path) -> None:
    store = _open(tmp_path, query="?segment_bytes=16KiB")
    _fill(store, range(12))  # three records per segment: several segments
    store.delete([key_for(i) for i in range(6)])  # the two oldest segments hold only dead pages
    store.close()
    old = time.time() - 3600
    tmp = tmp_path / ".HEAD.123.tmp"
    tmp.write_text("x")
    for path in [tmp, *tmp_path.glob("segments/*.seg")]:
        os.utime(path, (old, old))
    before = len(list(tmp_path.glob("segments/*.seg")))
    reopened = _open(tmp_path)
    assert not tmp.exists()
    assert len(list(tmp_path.glob("segments/*.seg"))) == before - 2
    assert all(_read(reopened, i) == page_bytes_for(i, PAGE) for i in range(6, 12))
    reopened.close()


def test_reopening_with_another_page_size_is_a_layout_mismatch(tmp_path: Path) -> None:
    _open(tmp_path).close()
    with pytest.raises(LayoutMismatch):
        _open(tmp_path, PAGE * 2)


@pytest.mark.parametrize("query", ["?verify=maybe", "?colour=red", "?max_bytes=lots",
                                   "?direct=perhaps", "?max_open_files=2"])
def test_bad_options_are_config_errors(tmp_path: Path, query: str) -> None:
    with pytest.raises(ConfigError):
        _open(tmp_path, query=query)


def test_url_must_name_a_local_directory() -> None:
    with pytest.raises(ConfigError):
        open_store("file://otherhost/x", page_bytes=PAGE)


def test_read_path_header_decoder_agrees_with_the_record_module() -> None:
    from kvtier.store.file.segment import _HEADER
    from kvtier.store.record import decode_header, encode_header

    payload = page_bytes_for(3, 100)
    header = encode_header(key_for(3), payload)
    magic, version, size, _flags, length, digest, key, _crc = _HEADER.unpack_from(header)
    assert (key, length, digest) == decode_header(header)
    assert (magic, size) == (b"KVTR", 64)


def test_batch_of_consecutive_pages_fails_only_the_damaged_one(tmp_path: Path) -> None:
    store = _open(tmp_path)
    _fill(store, range(6))  # consecutive slots: read back with one coalesced read
    _flip(store, 2, 9)
    out = [np.zeros(PAGE, np.uint8) for _ in range(6)]
    assert store.read_into([key_for(i) for i in range(6)], out) == [True, True, False, True,
                                                                    True, True]
    assert all(out[i].tobytes() == page_bytes_for(i, PAGE) for i in (0, 1, 3, 4, 5))
    assert store.stats().corrupt == 1
    seg, slot = split(store.index.where[key_for(4)])
    os.truncate(segment_path(store.segments_dir, seg), store.layout.payload_at(slot) + 10)
    found = store.read_into([key_for(i) for i in range(6)], out)
    assert found == [True, True, False, True, False, False]
    store.close()


def test_long_journal_replays_in_order_with_deletes_overwrites_and_bad_entries(
        tmp_path: Path) -> None:
    store = _open(tmp_path)
    for start in range(0, 200, 10):  # 200 puts in 20 appends
        _fill(store, range(start, start + 10))
    store.delete([key_for(i) for i in range(50, 60)])
    assert store.write([key_for(7)], [page_bytes_for(1007, PAGE)]) == [True]  # overwrite
    _fill(store, range(55, 57))  # put back after the delete
    store.close()
    journal = tmp_path / "journal.0"
    data = bytearray(journal.read_bytes())
    data[_put_entry_at(data, 120) + 3] ^= 0xFF  # damage the put of page 120
    journal.write_bytes(bytes(data))
    reopened = _open(tmp_path)
    expected = set(range(200)) - set(range(50, 60)) - {120} | {55, 56}
    present = reopened.contains([key_for(i) for i in range(200)])
    assert {i for i, p in enumerate(present) if p} == expected
    assert _read(reopened, 7) == page_bytes_for(1007, PAGE)
    assert _read(reopened, 56) == page_bytes_for(56, PAGE)
    assert reopened.journal.bad_entries == 1
    reopened.close()


# ---- batched records ---------------------------------------------------------------------


def _header_and_payload(store: FileStore, i: int) -> tuple[bytes, bytes]:
    seg, slot = split(store.index.where[key_for(i)])
    layout = store.layout
    with open(segment_path(store.segments_dir, seg), "rb") as f:
        f.seek(layout.header_at(slot))
        header = f.read(layout.header_stride)
        f.seek(layout.payload_at(slot))
        return header, f.read(layout.page_bytes)


@pytest.mark.parametrize("page", [448, PAGE, BIG])  # padded payloads, plain, a chunk table
def test_batch_read_judges_every_damaged_byte_as_the_single_record_check_does(
        tmp_path: Path, page: int) -> None:
    """One batch written at once (one pwritev) and read at once (one preadv, the batch
    verification): a flipped byte anywhere in one record's header or payload fails exactly
    the records that ``RecordLayout.verify`` fails on the same bytes, and no other."""
    store = _open(tmp_path, page)
    _fill(store, range(8))
    layout = store.layout
    header_offsets = [0, 4, 6, 8, 12, 20, 28, 59, 60, 63, layout.header_stride - 1]
    payload_offsets = [0, page // 2, page - 1]
    out = [np.zeros(page, np.uint8) for _ in range(8)]
    for n, (offset, in_header) in enumerate([(o, True) for o in header_offsets]
                                           + [(o, False) for o in payload_offsets]):
        victim = n % 8
        _flip(store, victim, offset, in_header)
        expected = []
        for i in range(8):
            header, payload = _header_and_payload(store, i)
            slot = split(store.index.where[key_for(i)])[1]
            expected.append(layout.verify(header, slot, key_for(i), memoryview(payload)).value
                            == "ok")
        assert store.read_into([key_for(i) for i in range(8)], out) == expected
        assert expected.count(False) <= 1  # damage never spreads to a neighbour
        for i in range(8):
            if expected[i]:
                assert out[i].tobytes() == page_bytes_for(i, page)
        _fill(store, range(8))  # good copies again (a damaged record is dropped once read)
    assert store.read_into([key_for(i) for i in range(8)], out) == [True] * 8
    store.close()
