"""SIGKILL a file-store writer at random moments, round after round; every acknowledged page
must reopen byte-for-byte, and nothing readable may be anything but the page it names."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvtier.store import open_store
from kvtier.store.file import FileStore
from store_contract import key_for, page_bytes_for

SRC = str(Path(__file__).resolve().parents[3] / "src")
PAGE = 4096
ROUNDS = 12
URL_QUERY = "?segment_bytes=64KiB"  # small segments: kills land in every phase, often
WRITER = r"""
import hashlib, random, sys
sys.path.insert(0, sys.argv[1])
import kvtier.store.file.store as file_module
file_module.COMPACT_MIN_ENTRIES = 40  # compactions happen (and get killed) too
from kvtier.store import open_store
root, start, page = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
store = open_store("file://" + root + sys.argv[5], page_bytes=page)
print("open", flush=True)
rng, i = random.Random(start), start
while True:
    n = rng.randint(1, 6)
    keys = [hashlib.sha256(b"kvtier-test-page-%d" % (i + j)).digest() for j in range(n)]
    pages = [random.Random(i + j).randbytes(page) for j in range(n)]
    acked = store.write(keys, pages)
    print(" ".join(str(i + j) for j in range(n) if acked[j]), flush=True)
    i += n
"""


def _kill_writer_at_random(root: Path, start: int, rng: random.Random) -> tuple[set[int], int]:
    """Run a writer, SIGKILL it after a random delay; (acknowledged pages, highest tried)."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, SRC, str(root), str(start), str(PAGE),
                             URL_QUERY], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "open\n"
    time.sleep(rng.uniform(0.0, 0.25))
    os.kill(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate()
    acked = {int(x) for line in out.splitlines(keepends=True) if line.endswith("\n")
             for x in line.split()}
    return acked, max(acked, default=start) + 8


def test_sigkilled_writer_loses_no_acknowledged_page(tmp_path: Path) -> None:
    rng = random.Random(2024)
    acked_all: set[int] = set()
    tried: list[range] = []
    recovery_s = []
    for round_ in range(ROUNDS):
        start = round_ * 100_000
        acked, top = _kill_writer_at_random(tmp_path, start, rng)
        acked_all |= acked
        tried.append(range(start, top))
        store = open_store(f"file://{tmp_path}{URL_QUERY}", page_bytes=PAGE)
        assert isinstance(store, FileStore)
        recovery_s.append(store.open_seconds)
        _check(store, acked_all, tried)
        store.close()
    assert len(acked_all) > ROUNDS  # the writers got somewhere before each kill
    assert max(recovery_s) < 2.0


def _check(store: FileStore, acked: set[int], tried: list[range]) -> None:
    indexes = sorted({i for r in tried for i in r})
    out = [np.zeros(PAGE, np.uint8) for _ in indexes]
    found = store.read_into([key_for(i) for i in indexes], out)
    readable = {i for i, ok in zip(indexes, found, strict=True) if ok}
    assert acked <= readable, f"lost acknowledged pages: {sorted(acked - readable)[:10]}"
    for i, ok, buf in zip(indexes, found, out, strict=True):
        if ok:
            assert buf.tobytes() == page_bytes_for(i, PAGE), f"page {i} has wrong bytes"
    assert store.stats().corrupt == 0
