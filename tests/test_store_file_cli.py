"""``kvtier store ls|stats|verify|gc`` and ``kvtier bench store`` on a file store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.store import open_store
from kvtier.store.file import FileStore
from kvtier.store.file_index import split
from kvtier.store.segment import segment_path
from store_contract import key_for, page_bytes_for

PAGE = 4096


@pytest.fixture
def filled(tmp_path: Path) -> str:
    url = f"file://{tmp_path}/store?segment_bytes=20KiB"
    store = open_store(url, page_bytes=PAGE)
    store.write([key_for(i) for i in range(12)], [page_bytes_for(i, PAGE) for i in range(12)])
    store.close()
    return f"file://{tmp_path}/store"


def test_ls_lists_every_page_oldest_first(filled: str, capsys) -> None:
    assert main(["store", "ls", "--url", filled, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["key"] for r in rows} == {key_for(i).hex() for i in range(12)}
    assert [(r["segment"], r["slot"]) for r in rows] == sorted((r["segment"], r["slot"]) for r in rows)


def test_stats_reads_the_page_size_from_the_manifest(filled: str, capsys) -> None:
    assert main(["store", "stats", "--url", filled, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["pages"], data["page_bytes"], data["segments"]) == (12, PAGE, 3)


def test_verify_passes_then_fails_with_counts_after_a_flipped_byte(filled: str, capsys) -> None:
    assert main(["store", "verify", "--url", filled, "--no-progress"]) == 0
    assert "verify: ok" in capsys.readouterr().out
    store = open_store(filled, page_bytes=PAGE)
    assert isinstance(store, FileStore)
    seg, slot = split(store.index.where[key_for(5)])
    path, offset = segment_path(store.segments_dir, seg), store.layout.payload_at(slot) + 100
    store.close()
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))
    assert main(["store", "verify", "--url", filled, "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert (result["ok"], result["corrupt"], result["failed"]) == (11, 1, 1)


def test_gc_evicts_down_to_the_target(filled: str, capsys) -> None:
    assert main(["store", "gc", "--url", filled, "--target", "20KiB"]) == 0
    assert "pages evicted" in capsys.readouterr().out
    store = open_store(filled, page_bytes=PAGE)
    assert store.stats().pages == 4 and store.contains([key_for(11)]) == [True]
    store.close()


def test_commands_never_create_a_store(tmp_path: Path, capsys) -> None:
    assert main(["store", "stats", "--url", f"file://{tmp_path}/nothing"]) == 2
    assert not (tmp_path / "nothing").exists()
    assert "no kvtier file store" in capsys.readouterr().err


def test_bench_store_reports_runs_beside_the_raw_baseline(tmp_path: Path, capsys) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "store", "--url", f"file://{tmp_path}/bench", "--pages", "64",
                 "--page-bytes", "16KiB", "--threads", "2", "--repeats", "1",
                 "--json", str(out)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    report = json.loads(out.read_text())
    run = report["runs"][0]
    for field in ("page_bytes", "threads", "cold", "read_gbps", "raw_read_gbps", "write_gbps",
                  "raw_write_gbps"):
        assert field in run
    assert run["read_misses"] == 0 and run["write_refused"] == 0 and "machine" in report
    assert last == f"read/raw: {run['read_vs_raw']:.3f}"
    assert not list((tmp_path / "bench").iterdir())  # the run's store is removed
