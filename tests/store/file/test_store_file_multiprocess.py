"""Two processes share one file-store directory: neither corrupts the other, each reads what the
other wrote, with and without a byte cap that makes both evict while the other works."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvtier.store import open_store
from kvtier.store.file import FileStore

SRC = str(Path(__file__).resolve().parents[3] / "src")
PAGE = 4096
PAGES = 150
WORKER = r"""
import hashlib, json, random, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
import kvtier.store.file.store as file_module
file_module.COMPACT_MIN_ENTRIES = 64
from kvtier.store import open_store
root, me, pages, query, page = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], 4096
key = lambda i: hashlib.sha256(b"kvtier-test-page-%d" % i).digest()
content = lambda i: random.Random(i).randbytes(page)
store = open_store("file://" + root + query, page_bytes=page)
mine = [me * 10_000 + i for i in range(pages)]
theirs = [(1 - me) * 10_000 + i for i in range(pages)]
shared = list(range(50_000, 50_020))   # both write these, with the same bytes
rng = random.Random(me)
wrong = seen_theirs = 0
def check(indexes):
    global wrong
    bufs = [np.zeros(page, np.uint8) for _ in indexes]
    found = store.read_into([key(i) for i in indexes], bufs)
    for i, ok, b in zip(indexes, found, bufs):
        wrong += ok and b.tobytes() != content(i)
    return sum(found)
for start in range(0, pages, 5):
    batch = mine[start:start + 5] + rng.sample(shared, 2)
    store.write([key(i) for i in batch], [content(i) for i in batch])
    seen_theirs += check(rng.sample(theirs, 5) + rng.sample(shared, 3))
waited = None
if "max_bytes" not in query:   # no eviction: all of theirs must show up
    t0 = time.monotonic()
    while not all(store.contains([key(i) for i in theirs])) and time.monotonic() - t0 < 30:
        time.sleep(0.01)
    waited = time.monotonic() - t0
    seen_theirs = check(theirs)
print(json.dumps({"wrong": wrong, "seen_theirs": seen_theirs, "waited_s": waited,
                  "stats": store.stats().as_dict(), "disk": store.disk_usage()}))
store.close()
"""


def _run_pair(root: Path, query: str) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, SRC, str(root), str(me), str(PAGES),
                               query], stdout=subprocess.PIPE, text=True) for me in (0, 1)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    return [json.loads(out.splitlines()[-1]) for out in outs]


def test_two_processes_read_each_others_pages_and_corrupt_nothing(tmp_path: Path) -> None:
    results = _run_pair(tmp_path, "")
    for result in results:
        assert result["wrong"] == 0 and result["stats"]["corrupt"] == 0
        assert result["seen_theirs"] == PAGES
    store = open_store(f"file://{tmp_path}", page_bytes=PAGE)
    assert store.stats().pages == 2 * PAGES + 20
    store.close()


def test_two_processes_under_a_cap_evict_without_serving_wrong_bytes(tmp_path: Path) -> None:
    cap = 96 * 4608  # 96 records of 4 KiB pages: far less than the two write
    results = _run_pair(tmp_path, f"?max_bytes={cap}&segment_bytes=24KiB")
    assert sum(r["stats"]["evicted"] for r in results) > 0
    for result in results:
        assert result["wrong"] == 0 and result["stats"]["corrupt"] == 0
    store = open_store(f"file://{tmp_path}?max_bytes={cap}", page_bytes=PAGE)
    assert isinstance(store, FileStore)
    active_slack = 2 * store.layout.segment_bytes  # each writer's open segment
    assert store.disk_usage()["segment_bytes"] <= cap + active_slack
    store.close()
