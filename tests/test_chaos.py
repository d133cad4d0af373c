"""The core of ``benchmarks/store/chaos.py`` on kvtier's own stores: under every fault that needs no
root (bit flips, zeroed ranges, truncation, another page's bytes, a stale older format, lost
index or manifest, another shape / page size / dtype / TP size / fine-tune, clock skew; on Redis
also another tenant's value, eviction mid-read, a restart, a paused server, dropped
connections) kvtier serves no wrong page, raises nothing to the caller and keeps every page the
fault did not touch; a server restarted on a damaged disk directory (or with other weights under
the same model name) answers as ``--no-cache`` does. The kill -9 fault is
``tests/store/file/test_store_file_crash.py``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from redis_server import needs_redis

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "store" / "chaos.py"
sys.path.insert(0, str(_PATH.parent))  # chaos.py imports its folder's modules by name
_SPEC = importlib.util.spec_from_file_location("kvtier_chaos", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
chaos = importlib.util.module_from_spec(_SPEC)
sys.modules["kvtier_chaos"] = chaos
_SPEC.loader.exec_module(chaos)

#: Faults that make a whole store unreadable by design: the pages are refused (counted as
#: lost), never served wrong. (A deleted index is rebuilt from the segments: nothing is lost.)
LOSES_ALL = {"deleted_manifest"}
FILE_FAULTS = tuple(f for f in chaos.FILE_FAULTS
                    if f not in ("kill9_mid_write", "full_disk", "read_only_disk"))


def _check(results: dict[str, dict[str, object]]) -> None:
    for fault, r in results.items():
        assert r["wrong"] == 0, (fault, r)
        assert r["errors"] == 0, (fault, r)
        if fault not in LOSES_ALL:
            assert r["lost"] == 0, (fault, r)


def test_file_store_serves_no_wrong_page_under_any_fault() -> None:
    results = chaos.run_file_faults("kvtier-file", FILE_FAULTS)
    _check(results)
    assert results["bit_flip"]["refused"] == len(chaos.TARGETS)
    assert results["other_tp_size"]["refused"] == 0  # layout-neutral pages serve a TP rank
    assert results["fine_tune_same_name"]["refused"] == chaos.PAGES
    assert results["deleted_index"]["refused"] == 0  # rebuilt from the segments' records


@needs_redis
@pytest.mark.timeout(120)
def test_redis_store_serves_no_wrong_page_under_any_fault() -> None:
    results = chaos.run_redis_faults(chaos.REDIS_FAULTS)
    _check(results)
    assert results["tenant_overwrite"]["refused"] == len(chaos.TARGETS)


def test_a_restarted_server_answers_as_without_cache_on_a_damaged_disk() -> None:
    results = chaos.run_server_faults(("bit_flip", "fine_tune_same_name"))
    assert int(results["none"]["note"].split()[0]) > 0  # undamaged, the disk serves hits
    for fault, r in results.items():
        assert r["wrong"] == 0 and r["errors"] == 0, (fault, r)
