"""Which on-disk layout should the file store use? One file per page against append-only segments.

Writes the same pages both ways into a scratch directory on the disk under test, then reads them
back (warm page cache, and cold after dropping caches when run as root), with a plain thread pool
of ``os.preadv`` calls into page-aligned buffers. No checksums, no index: only the cost of the
layout itself. Prints a table and writes JSON with machine info. Main thread plus its readers.

    python benchmarks/probes/disk_layout_probe.py --dir /var/tmp/kvtier-probe --total 1GiB \
        --page-bytes 64KiB --threads 2 --json benchmarks/results/disk_layout_probe.json
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from kvtier.machine import format_table, write_report
from kvtier.units import parse_size


def drop_caches() -> bool:
    """Drop the page cache (root only); True when it worked."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _aligned(nbytes: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)


def write_files(root: Path, pages: int, page: np.ndarray) -> float:
    root.mkdir(parents=True)
    start = time.perf_counter()
    for i in range(pages):
        fd = os.open(root / f"{i:08d}.page", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, page)
        finally:
            os.close(fd)
    os.sync()
    return time.perf_counter() - start


def write_segments(root: Path, pages: int, page: np.ndarray, segment_pages: int) -> float:
    root.mkdir(parents=True)
    start = time.perf_counter()
    for seg in range(0, pages, segment_pages):
        fd = os.open(root / f"{seg:08d}.seg", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for i in range(min(segment_pages, pages - seg)):
                os.pwrite(fd, page, i * page.nbytes)
        finally:
            os.close(fd)
    os.sync()
    return time.perf_counter() - start


def read_files(root: Path, pages: int, page_bytes: int, threads: int) -> float:
    dest = _aligned(page_bytes * threads).reshape(threads, page_bytes)

    def work(t: int) -> None:
        for i in range(t, pages, threads):
            fd = os.open(root / f"{i:08d}.page", os.O_RDONLY)
            try:
                os.preadv(fd, [dest[t]], 0)
            finally:
                os.close(fd)

    return _timed_pool(work, threads)


def read_segments(root: Path, pages: int, page_bytes: int, threads: int,
                  segment_pages: int) -> float:
    dest = _aligned(page_bytes * threads).reshape(threads, page_bytes)
    fds = [os.open(root / f"{s:08d}.seg", os.O_RDONLY) for s in range(0, pages, segment_pages)]

    def work(t: int) -> None:
        for i in range(t, pages, threads):
            os.preadv(fds[i // segment_pages], [dest[t]], (i % segment_pages) * page_bytes)

    try:
        return _timed_pool(work, threads)
    finally:
        for fd in fds:
            os.close(fd)


def _timed_pool(work, threads: int) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(threads)))
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="Scratch directory on the disk under test.")
    parser.add_argument("--total", default="1GiB", help="Bytes of pages per layout.")
    parser.add_argument("--page-bytes", default="64KiB")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--segment-bytes", default="256MiB")
    parser.add_argument("--json", help="Write results here.")
    args = parser.parse_args()
    page_bytes, total = parse_size(args.page_bytes), parse_size(args.total)
    pages, segment_pages = total // page_bytes, max(1, parse_size(args.segment_bytes) // page_bytes)
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    page = _aligned(page_bytes)
    page[:] = np.random.default_rng(0).integers(0, 256, page_bytes, dtype=np.uint8)
    gb = pages * page_bytes / 1e9
    rows, runs = [], []
    layouts = {
        "file_per_page": (lambda: write_files(root / "files", pages, page),
                          lambda: read_files(root / "files", pages, page_bytes, args.threads)),
        "segments": (lambda: write_segments(root / "segs", pages, page, segment_pages),
                     lambda: read_segments(root / "segs", pages, page_bytes, args.threads,
                                           segment_pages)),
    }
    for name, (write, read) in layouts.items():
        write_s = write()
        cold = drop_caches()
        cold_s = read() if cold else float("nan")
        read()  # fill the page cache
        warm_s = read()
        run = {"layout": name, "pages": pages, "page_bytes": page_bytes, "threads": args.threads,
               "write_gbps": gb / write_s, "cold_read_gbps": gb / cold_s if cold else None,
               "warm_read_gbps": gb / warm_s, "caches_dropped": cold}
        runs.append(run)
        rows.append([name, pages, run["write_gbps"], run["cold_read_gbps"] or "-",
                     run["warm_read_gbps"]])
    shutil.rmtree(root, ignore_errors=True)
    print(format_table(["layout", "pages", "write GB/s", "cold read GB/s", "warm read GB/s"], rows))
    if args.json:
        write_report(args.json, "disk_layout_probe", {"runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
