"""How the ``file://`` store scales with the number of pages: open time, contains, index memory.

Writes ``--pages`` small pages (``--page-bytes``, default 448: one 512-byte record each, so a
million pages take 512 MB of disk) in large batches, closes the store, then times opening it
again (warm, and cold after dropping the page cache when root), ``contains`` over 100k keys, and
reports the segment and file counts and the process's resident memory. Open time is given as
wall and CPU seconds: on a shared machine the wall time mostly measures the wait for a core.
Main thread.

    python benchmarks/disk_scale.py --dir /var/tmp/kvtier-scale --pages 1000000 \
        --json benchmarks/results/disk_scale.json
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvtier.commands.bench_store import drop_caches
from kvtier.machine import format_table, write_report
from kvtier.store import open_store
from kvtier.store.file import FileStore


def _keys(start: int, count: int) -> list[bytes]:
    return [hashlib.sha256(b"scale-%d" % i).digest() for i in range(start, start + count)]


def fill(url: str, pages: int, page_bytes: int, batch: int) -> float:
    store = open_store(url, page_bytes=page_bytes)
    page = bytes(range(256)) * (page_bytes // 256 + 1)
    begin = time.perf_counter()
    for start in range(0, pages, batch):
        count = min(batch, pages - start)
        assert all(store.write(_keys(start, count), [page[:page_bytes]] * count))
    seconds = time.perf_counter() - begin
    store.close()
    return seconds


def reopen(url: str, page_bytes: int, pages: int, cold: bool) -> dict:
    dropped = drop_caches() if cold else False
    begin, cpu = time.perf_counter(), time.process_time()
    store = open_store(url, page_bytes=page_bytes)
    open_s, open_cpu_s = time.perf_counter() - begin, time.process_time() - cpu
    assert isinstance(store, FileStore)
    lookups = _keys(0, min(100_000, pages))
    begin = time.perf_counter()
    present = sum(store.contains(lookups))
    contains_s = time.perf_counter() - begin
    usage = store.disk_usage()
    store.close()
    return {"cold": cold, "caches_dropped": dropped, "open_s": open_s, "open_cpu_s": open_cpu_s,
            "contains_ms_per_100k": contains_s * 1e3 * 100_000 / len(lookups),
            "present": present, "segments": usage["segments"],
            "journal_generation": usage["journal_generation"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--pages", type=int, default=1_000_000)
    parser.add_argument("--page-bytes", type=int, default=448)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--json")
    args = parser.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    url = f"file://{root}"
    fill_s = fill(url, args.pages, args.page_bytes, args.batch)
    files = sum(1 for _ in root.rglob("*"))
    runs = [reopen(url, args.page_bytes, args.pages, cold) for cold in (False, True)]
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    shutil.rmtree(root, ignore_errors=True)
    print(f"{args.pages} pages of {args.page_bytes} bytes written in {fill_s:.1f} s "
          f"({args.pages / fill_s:.0f} pages/s); {files} files and folders; peak RSS {rss_mib:.0f} MiB")
    print(format_table(["cache", "open s", "open cpu s", "contains ms/100k", "present",
                        "segments"],
                       [["cold" if r["cold"] else "warm", r["open_s"], r["open_cpu_s"],
                         r["contains_ms_per_100k"], r["present"], r["segments"]] for r in runs]))
    print(f"load average: {os.getloadavg()}")
    if args.json:
        write_report(args.json, "disk_scale", {"pages": args.pages, "page_bytes": args.page_bytes,
                                               "fill_s": fill_s, "files": files,
                                               "peak_rss_mib": rss_mib, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
