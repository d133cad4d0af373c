"""How the ``file://`` store scales with the number of pages: open time, contains, index memory,
files on disk.

Writes ``--pages`` small pages (``--page-bytes``, default 448: one 512-byte payload slot each,
so ten million pages take about 6 GB of disk) in large batches, closes the store, then opens it
again ``--opens`` times, alternating warm and cold page cache (cold: the page cache dropped
first, as root). Each open runs in a fresh process, which reports the open's wall and CPU
seconds, ``contains`` over 100k keys, and the process's resident memory once the index is
loaded (VmRSS) and at its peak (VmHWM). The fill's files and inodes are counted. Open time is
given as wall and CPU seconds: on a shared machine wall time mostly measures the wait for a
core. Main thread (and one child process per open).

    python benchmarks/store/disk_scale.py --dir /var/tmp/kvtier-scale --pages 10000000 \
        --json benchmarks/results/disk_scale.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from kvtier.bench.page_io import drop_caches
from kvtier.machine import format_table, write_report
from kvtier.store import open_store
from kvtier.store.file import FileStore

CONTAINS_KEYS = 100_000


def _keys(start: int, count: int) -> list[bytes]:
    return [hashlib.sha256(b"scale-%d" % i).digest() for i in range(start, start + count)]


def fill(url: str, pages: int, page_bytes: int, batch: int) -> float:
    store = open_store(url, page_bytes=page_bytes)
    page = (bytes(range(256)) * (page_bytes // 256 + 1))[:page_bytes]
    begin = time.perf_counter()
    for start in range(0, pages, batch):
        count = min(batch, pages - start)
        assert all(store.write(_keys(start, count), [page] * count))
    seconds = time.perf_counter() - begin
    store.close()
    return seconds


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def open_once(url: str, page_bytes: int, pages: int) -> dict:
    """Open the store, time contains, report memory (runs in a child process)."""
    lookups = _keys(0, min(CONTAINS_KEYS, pages))
    base_rss = _status_kib("VmRSS")
    begin, cpu = time.perf_counter(), time.process_time()
    store = open_store(url, page_bytes=page_bytes)
    open_s, open_cpu_s = time.perf_counter() - begin, time.process_time() - cpu
    assert isinstance(store, FileStore)
    begin = time.perf_counter()
    present = sum(store.contains(lookups))
    contains_s = time.perf_counter() - begin
    usage = store.disk_usage()
    result = {"open_s": open_s, "open_cpu_s": open_cpu_s,
              "contains_ms_per_100k": contains_s * 1e3 * CONTAINS_KEYS / len(lookups),
              "present": present, "pages": store.stats().pages, "segments": usage["segments"],
              "journal_entries": usage["journal_entries"],
              "index_rss_mib": (_status_kib("VmRSS") - base_rss) / 1024,
              "rss_mib": _status_kib("VmRSS") / 1024, "peak_rss_mib": _status_kib("VmHWM") / 1024}
    store.close()
    return result


def reopen(url: str, page_bytes: int, pages: int, cold: bool) -> dict:
    dropped = drop_caches() if cold else False
    done = subprocess.run([sys.executable, __file__, "--child", url, "--page-bytes",
                           str(page_bytes), "--pages", str(pages)],
                          capture_output=True, text=True, check=True)
    return {"cold": cold, "caches_dropped": dropped, **json.loads(done.stdout.splitlines()[-1])}


def count_files(root: Path) -> dict:
    files = dirs = 0
    for _, dirnames, filenames in os.walk(root):
        files += len(filenames)
        dirs += len(dirnames)
    return {"files": files, "dirs": dirs,
            "disk_bytes": sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir")
    parser.add_argument("--pages", type=int, default=1_000_000)
    parser.add_argument("--page-bytes", type=int, default=448)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--opens", type=int, default=6, help="Opens, alternating warm and cold.")
    parser.add_argument("--keep", action="store_true", help="Keep the store (and reuse it).")
    parser.add_argument("--json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(open_once(args.child, args.page_bytes, args.pages)))
        return 0
    root = Path(args.dir)
    url = f"file://{root}"
    fill_s = None
    if not (args.keep and (root / "kvtier-store.json").exists()):
        shutil.rmtree(root, ignore_errors=True)
        fill_s = fill(url, args.pages, args.page_bytes, args.batch)
    on_disk = count_files(root)
    runs = [reopen(url, args.page_bytes, args.pages, cold=i % 2 == 1) for i in range(args.opens)]
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    summary = []
    for cold in (False, True):
        mine = [r for r in runs if r["cold"] == cold]
        if mine:
            summary.append({"cold": cold, "opens": len(mine),
                            **{k: statistics.median(r[k] for r in mine)
                               for k in ("open_s", "open_cpu_s", "contains_ms_per_100k",
                                         "index_rss_mib", "peak_rss_mib")},
                            "open_s_max": max(r["open_s"] for r in mine)})
    if fill_s is not None:
        print(f"{args.pages} pages of {args.page_bytes} bytes written in {fill_s:.1f} s "
              f"({args.pages / fill_s:.0f} pages/s)")
    print(f"on disk: {on_disk['files']} files, {on_disk['dirs']} folders, "
          f"{on_disk['disk_bytes'] / 1e9:.2f} GB; {runs[0]['segments']} segments, "
          f"{runs[0]['journal_entries']} journal entries")
    print(format_table(["cache", "opens", "open s", "open s max", "open cpu s",
                        "contains ms/100k", "index RSS MiB", "peak RSS MiB"],
                       [["cold" if s["cold"] else "warm", s["opens"], s["open_s"], s["open_s_max"],
                         s["open_cpu_s"], s["contains_ms_per_100k"], s["index_rss_mib"],
                         s["peak_rss_mib"]] for s in summary]))
    print(f"load average: {os.getloadavg()}")
    if args.json:
        write_report(args.json, "disk_scale", {"pages": args.pages, "page_bytes": args.page_bytes,
                                               "fill_s": fill_s, **on_disk, "summary": summary,
                                               "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
