"""Where the ``file://`` store's whole-page read spends its time, stage by stage, beside the raw
read of the same bytes.

Fills a store with ``--total`` bytes of pages (warm in the page cache), then, on one thread,
times in interleaved rounds (median of ``--rounds``) for batches of ``--batch`` pages:

    raw            os.preadv of each payload at its place in the segment files (the baseline
                   of ``kvtier bench store``)
    copy           one os.preadv per run of adjacent payloads (what the store's read does)
    hash           xxh3 of every page of a batch already in the buffers
    headers        the batch's header checks without the payload checksum (verify_many)
    read_many      the record layer: runs, headers, payloads, verification
    read_into      the whole call: views, index lookups, pins, counters

in CPU seconds of the thread (``time.thread_time``: on a shared machine wall time mostly
measures the wait for a core) and wall seconds. ``hash`` hashes the buffers as ``copy`` left
them: from memory, not cache, once a batch outgrows the cache (1 MiB pages). ``python`` is
read_into less read_many, plus headers: the per-page cost of the call's bookkeeping (views,
index lookups, pins, counters) and of the header checks, none of which moves or checksums
payload bytes. Main thread.

    python benchmarks/probes/disk_read_profile.py --dir /var/tmp/kvtier-profile --page-bytes 64KiB,1MiB \
        --json benchmarks/results/disk_read_profile.json
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from kvtier.bench.page_io import aligned_pages, run_batches, source_pages
from kvtier.machine import format_table, write_report
from kvtier.store.file import FileStore
from kvtier.store.file.record_io import plans_of
from kvtier.units import parse_size

STAGES = ("raw", "copy", "hash", "headers", "read_many", "read_into")


def fill_store(root: Path, page_bytes: int, pages: int, batch: int, threads: int = 1,
               tag: bytes = b"profile") -> tuple[FileStore, list[bytes]]:
    """A fresh store under ``root`` holding ``pages`` pages, written in batches by ``threads``
    threads; returns it and the keys in page order."""
    shutil.rmtree(root, ignore_errors=True)
    store = FileStore(root, page_bytes)
    keys = [hashlib.sha256(b"%s-%d" % (tag, i)).digest() for i in range(pages)]
    sources = source_pages(page_bytes)

    def write(_thread: int, batch_keys: list[bytes], indexes: range) -> None:
        if not all(store.write(batch_keys, [sources[i % len(sources)] for i in indexes])):
            raise RuntimeError("the store refused a write while filling")

    run_batches(threads, keys, batch, write)
    return store, keys


def stages(store: FileStore, keys: list[bytes], batch: int) -> dict[str, Callable[[], None]]:
    """One pass over every page per stage."""
    layout, io = store.layout, store.io
    dest = aligned_pages(batch, store.page_bytes)
    locs, fds = store._pin(keys)
    plans = plans_of(locs, fds)
    starts = range(0, len(keys), batch)
    headers = bytearray(batch * layout.header_stride)
    fd0, slot0 = plans[0]  # type: ignore[misc]
    os.preadv(fd0, [headers], layout.header_at(slot0))

    def raw() -> None:
        for start in starts:
            for j, plan in enumerate(plans[start:start + batch]):
                os.preadv(plan[0], [dest[j]], layout.payload_at(plan[1]))  # type: ignore[index]

    def copy() -> None:
        for start in starts:
            chunk = plans[start:start + batch]
            first = 0
            while first < len(chunk):  # the same runs the store reads
                last = first + 1
                while (last < len(chunk) and last - first < io.max_run
                       and chunk[last] == (chunk[first][0], chunk[first][1] + last - first)):  # type: ignore[index]
                    last += 1
                os.preadv(chunk[first][0], dest[first:last],  # type: ignore[index]
                          layout.payload_at(chunk[first][1]))  # type: ignore[index]
                first = last

    def hash_() -> None:
        for _ in starts:
            for view in dest:
                xxhash.xxh3_64_intdigest(view)

    def header_checks() -> None:
        for start in starts:
            layout.verify_many(headers, slot0, keys[start:start + batch], dest,
                               check_payload=False)

    def read_many() -> None:
        for start in starts:
            io.read_many(locs[start:start + batch], fds, keys[start:start + batch], dest)

    def read_into() -> None:
        for start in starts:
            store.read_into(keys[start:start + batch], dest)

    return dict(zip(STAGES, (raw, copy, hash_, header_checks, read_many, read_into),
                    strict=True))


def profile(root: Path, page_bytes: int, total: int, batch: int, rounds: int) -> dict:
    pages = max(batch, total // page_bytes)
    store, keys = fill_store(root, page_bytes, pages, batch)
    try:
        passes = stages(store, keys, batch)
        for run in passes.values():
            run()  # warm the page cache and the code paths
        cpu: dict[str, list[float]] = {name: [] for name in passes}
        wall: dict[str, list[float]] = {name: [] for name in passes}
        for _ in range(rounds):
            for name, run in passes.items():
                begin, begin_cpu = time.perf_counter(), time.thread_time()
                run()
                cpu[name].append((time.thread_time() - begin_cpu) / pages * 1e6)
                wall[name].append((time.perf_counter() - begin) / pages * 1e6)
        row = {"page_bytes": page_bytes, "pages": pages, "batch": batch, "max_run": store.io.max_run,
               "cpu_us": {n: statistics.median(v) for n, v in cpu.items()},
               "wall_us": {n: statistics.median(v) for n, v in wall.items()}}
        c = row["cpu_us"]
        row["python_cpu_us"] = c["read_into"] - c["read_many"] + c["headers"]
        row["read_into_vs_raw_cpu"] = c["raw"] / c["read_into"]
        row["read_into_vs_raw_wall"] = row["wall_us"]["raw"] / row["wall_us"]["read_into"]
        return row
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--page-bytes", default="64KiB,1MiB")
    parser.add_argument("--total", default="256MiB")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = [profile(Path(args.dir), parse_size(p), parse_size(args.total), args.batch, args.rounds)
            for p in args.page_bytes.split(",")]
    headers = ["page", "clock", *STAGES, "python", "raw/read_into"]
    table = []
    for r in rows:
        table.append([r["page_bytes"], "cpu", *(r["cpu_us"][s] for s in STAGES),
                      r["python_cpu_us"], r["read_into_vs_raw_cpu"]])
        table.append([r["page_bytes"], "wall", *(r["wall_us"][s] for s in STAGES), "",
                      r["read_into_vs_raw_wall"]])
    print("microseconds per page, one thread, median of interleaved rounds")
    print(format_table(headers, table))
    print(f"load average: {os.getloadavg()}")
    if args.json:
        write_report(args.json, "disk_read_profile", {"rounds": args.rounds, "runs": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
