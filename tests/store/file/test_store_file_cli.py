"""``kvtier store ls|stats|verify|gc`` and ``kvtier bench store`` on a file store."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.errors import ConfigError
from kvtier.store import open_store
from kvtier.store.file import FileStore
from kvtier.store.file.index import split
from kvtier.store.file.segment import segment_path
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


# ---- errors: exit 2 and one line for usage and open errors, exit 1 only for damage ----------


def test_verify_of_a_store_with_a_directory_named_like_a_segment_passes(filled: str,
                                                                         capsys) -> None:
    stray = Path(filled.removeprefix("file://")) / "segments" / "0000000778.seg"
    stray.mkdir()
    os.utime(stray, (time.time() - 3600,) * 2)
    assert main(["store", "verify", "--url", filled, "--no-progress"]) == 0
    assert "verify: ok" in capsys.readouterr().out


def test_verify_of_a_store_that_cannot_be_opened_is_exit_2_not_damage(filled: str,
                                                                      capsys) -> None:
    root = Path(filled.removeprefix("file://"))
    (root / "HEAD").write_text("garbage\n")
    assert main(["store", "verify", "--url", filled, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: ") and "HEAD" in err and "Traceback" not in err
    (root / "kvtier-store.json").unlink()
    assert main(["store", "verify", "--url", filled, "--no-progress"]) == 2
    assert "no kvtier file store" in capsys.readouterr().err


def test_a_garbage_head_file_is_one_error_line_and_exit_2(filled: str, capsys) -> None:
    root = Path(filled.removeprefix("file://"))
    (root / "HEAD").write_bytes(b"\x00\xffjunk")
    for command in ("stats", "ls"):
        assert main(["store", command, "--url", filled]) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvtier: error: ") and "HEAD" in err


@pytest.mark.parametrize("url", ["file://relative/path", "file:relative/path",
                                 "file://otherhost/abs/path"])
def test_a_file_url_that_names_no_local_absolute_directory_is_refused(
        tmp_path: Path, monkeypatch, capsys, url: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "relative" / "path").mkdir(parents=True)
    open_store(f"file://{tmp_path}/path", page_bytes=PAGE).close()  # a store at /.../path
    for argv in (["store", "stats", "--url", url],
                 ["bench", "store", "--url", url, "--pages", "4", "--page-bytes", "4KiB"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvtier: error: ") and url in err and "absolute" in err
    with pytest.raises(ConfigError, match="absolute"):
        open_store(url, page_bytes=PAGE)
    assert list((tmp_path / "relative" / "path").iterdir()) == []


@pytest.mark.parametrize("flag, value", [("--pages", "0"), ("--pages", "-5"),
                                         ("--pages", "many"), ("--page-bytes", "0"),
                                         ("--page-bytes", "abc"), ("--page-bytes", "4KiB,0"),
                                         ("--total", "0"), ("--threads", "0"),
                                         ("--batch", "0"), ("--repeats", "0")])
def test_bench_store_refuses_bad_sizes_and_counts_as_usage_errors(
        tmp_path: Path, capsys, flag: str, value: str) -> None:
    argv = ["bench", "store", "--url", f"file://{tmp_path}/bench", flag, value]
    if flag not in ("--pages", "--total"):
        argv += ["--pages", "4"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err
    assert repr(value.split(",")[-1]) in err or "at least 1, got" in err
    assert "Traceback" not in err and not (tmp_path / "bench").exists()
