"""Opening a damaged or odd ``file://`` store directory: a lost manifest, a manifest of another
layout, a directory named like a segment, generations left by a crashed compaction, a garbage
``HEAD``. Each refuses with a clear ``StoreUnavailable`` or is cleaned up; none ever serves bytes
that are not the page."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

import kvtier.store.file.store as file_module
from kvtier.errors import StoreUnavailable
from kvtier.store import open_store
from kvtier.store.file import FileStore
from kvtier.store.file.segment import MANIFEST, segment_path
from store_contract import key_for, page_bytes_for

BIG = 64 << 10


def open_file(root: Path, page: int = BIG, **options: object) -> FileStore:
    store = open_store(f"file://{root}", page_bytes=page, **options)
    assert isinstance(store, FileStore)
    return store


def fill(store: FileStore, indexes: range) -> None:
    for start in range(indexes.start, indexes.stop, 50):
        batch = range(start, min(start + 50, indexes.stop))
        pages = [page_bytes_for(i, store.page_bytes) for i in batch]
        assert store.write([key_for(i) for i in batch], pages) == [True] * len(pages)


def served_wrong(store: FileStore, indexes: range) -> tuple[int, int]:
    """(hits, hits whose bytes are not the page written)."""
    hits = wrong = 0
    for i in indexes:
        out = bytearray(store.page_bytes)
        if store.read_into([key_for(i)], [out]) == [True]:
            hits += 1
            wrong += bytes(out) != page_bytes_for(i, store.page_bytes)
    return hits, wrong


def test_a_store_whose_manifest_was_deleted_refuses_to_open(tmp_path: Path) -> None:
    """600 pages of 64 KiB in 32 MiB segments, the manifest removed: reopening (with either
    verification) must refuse, naming the missing file, and must not write a new manifest."""
    root = tmp_path / "store"
    store = open_file(root, segment_bytes="32MiB")
    fill(store, range(600))
    store.close()
    (root / MANIFEST).unlink()
    for verify in ("header", "full"):
        with pytest.raises(StoreUnavailable, match=MANIFEST):
            open_file(root, verify=verify)
    assert not (root / MANIFEST).exists()


def test_a_journal_without_segments_or_manifest_also_refuses(tmp_path: Path) -> None:
    root = tmp_path / "store"
    open_file(root).close()  # an empty store: manifest and journal.0
    (root / MANIFEST).unlink()
    with pytest.raises(StoreUnavailable, match=MANIFEST):
        open_file(root)


def test_header_verification_never_serves_bytes_from_another_layout(tmp_path: Path) -> None:
    """The manifest replaced by one of another segment size (headers stay where they were,
    payload offsets move): with ``verify=header`` every read is a miss or the right page."""
    root, other = tmp_path / "store", tmp_path / "other"
    store = open_file(root, segment_bytes="32MiB")
    fill(store, range(600))
    store.close()
    open_file(other, segment_bytes="4MiB").close()
    theirs = json.loads((other / MANIFEST).read_text())
    assert theirs["slots"] != json.loads((root / MANIFEST).read_text())["slots"]
    (root / MANIFEST).write_text(json.dumps(theirs))
    store = open_file(root, verify="header")
    try:
        hits, wrong = served_wrong(store, range(600))
        assert wrong == 0, f"{wrong} of {hits} hits were not the page"
        assert store.stats().corrupt == 600 - hits
    finally:
        store.close()


def test_a_directory_named_like_a_segment_neither_breaks_opening_nor_writing(
        tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = open_file(root, page=4096)
    fill(store, range(4))
    store.close()
    stray = segment_path(root / "segments", 778)
    in_the_way = segment_path(root / "segments", 1)  # the id the next segment would take
    old = time.time() - 3600
    for directory in (stray, in_the_way):
        directory.mkdir()
        os.utime(directory, (old, old))  # older than the leftover age: cleanup looks at it
    store = open_file(root, page=4096)
    try:
        assert "segments" in store.disk_usage() and stray.is_dir() and in_the_way.is_dir()
        assert served_wrong(store, range(4)) == (4, 0)
        store.writer.seal_all()
        fill(store, range(4, 8))
        assert served_wrong(store, range(8)) == (8, 0)
        assert store.disk_usage()["segments"] == 2
    finally:
        store.close()


def test_generations_left_by_a_crashed_compaction_are_removed_at_open(
        tmp_path: Path, monkeypatch) -> None:
    """A compaction killed after it moved ``HEAD`` but before it deleted the generation before
    last leaves those files; the next open removes every generation but the current one and
    its predecessor, and reports what the index files take."""
    monkeypatch.setattr(file_module, "COMPACT_MIN_ENTRIES", 16)
    root = tmp_path / "store"
    store = open_file(root, page=4096)
    real_unlink = Path.unlink

    def crash_before_cleanup(path: Path, missing_ok: bool = False) -> None:
        if path.name.startswith(("journal.", "snapshot.")):
            return  # the process "died" before removing old generations
        real_unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", crash_before_cleanup)
    for _ in range(60):
        fill(store, range(10))  # overwrites: the journal outgrows the live pages
    store.close()
    monkeypatch.setattr(Path, "unlink", real_unlink)
    gens = sorted(int(p.name.split(".")[1]) for p in root.glob("journal.*"))
    assert len(gens) >= 4, gens
    head = int((root / "HEAD").read_text())
    store = open_file(root, page=4096)
    try:
        left = sorted(p.name for p in root.iterdir() if p.name.startswith(("journal.", "snapshot.")))
        assert left == sorted([f"journal.{head - 1}", f"snapshot.{head - 1}", f"journal.{head}",
                               f"snapshot.{head}"]), left
        assert served_wrong(store, range(10)) == (10, 0)
        usage = store.disk_usage()
        assert usage["index_bytes"] == sum(os.path.getsize(root / name) for name in left)
    finally:
        store.close()


def test_a_garbage_head_file_is_a_store_unavailable_error(tmp_path: Path) -> None:
    root = tmp_path / "store"
    open_file(root, page=4096).close()
    (root / "HEAD").write_text("not a number\n")
    with pytest.raises(StoreUnavailable, match="HEAD"):
        open_file(root, page=4096)


def test_a_store_of_format_1_still_reads_and_takes_new_pages(tmp_path: Path,
                                                              monkeypatch) -> None:
    """A directory written before headers carried their place (manifest version 1, flags 0,
    snapshots without a segment id) opens, serves its pages and takes new ones."""
    import dataclasses

    import xxhash

    import kvtier.store.file.segment as segment

    root = tmp_path / "store"
    plan = segment.RecordLayout.plan
    with monkeypatch.context() as patch:
        patch.setattr(segment, "FORMAT_VERSION", 1)
        patch.setattr(segment.RecordLayout, "plan", classmethod(
            lambda cls, *args: dataclasses.replace(plan(*args), places=False)))
        patch.setattr(file_module, "COMPACT_MIN_ENTRIES", 8)
        store = open_file(root, page=4096)
        for _ in range(10):
            fill(store, range(6))  # overwrites: compacts, so a snapshot exists
        store.close()
    assert json.loads((root / MANIFEST).read_text())["version"] == 1
    snapshots = sorted(root.glob("snapshot.*"))
    assert snapshots
    for path in snapshots:  # rewrite each snapshot as format 1 wrote it
        data = bytearray(path.read_bytes())
        body = bytes(data[64:])
        data[0:8] = b"KVTSNAP1"
        data[16:24] = xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")
        data[24:32] = bytes(8)
        path.write_bytes(bytes(data))
    store = open_file(root, page=4096)
    try:
        assert not store.layout.places
        assert served_wrong(store, range(6)) == (6, 0)
        fill(store, range(6, 12))
        assert served_wrong(store, range(12)) == (12, 0)
    finally:
        store.close()
    store = open_file(root, page=4096, verify="header")
    try:
        assert served_wrong(store, range(12)) == (12, 0)
    finally:
        store.close()
