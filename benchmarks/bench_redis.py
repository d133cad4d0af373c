"""Redis store throughput beside redis-benchmark, side by side and interleaved in one run.

For each value size, every round runs, back to back on one server: kvtier's batched writes of
the whole working set, ``redis-benchmark -t set`` at the same value size, pipeline depth and
keyspace, kvtier's batched reads, ``redis-benchmark -t get``, and the same bytes through a plain
redis-py pipeline (hiredis) as a second reference. Interleaving keeps load from other processes
on a shared machine from favouring one side; the table reports medians over rounds and the
kvtier / redis-benchmark ratio of those medians. Without ``--url`` it starts its own
``redis-server`` on a free loopback port and stops it at the end. Main thread only.

    python benchmarks/bench_redis.py --out benchmarks/results/redis_store
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvtier.commands.raw_redis import fill_keyspace, redis_py_pipeline, run_redis_benchmark
from kvtier.config import parse_size
from kvtier.machine import format_table, write_report
from kvtier.store import open_store


@contextlib.contextmanager
def own_server() -> Iterator[str]:
    """A throwaway redis-server on a free loopback port (no persistence); yields its URL."""
    import redis

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="kvtier-bench-redis-")
    process = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                                "--save", "", "--appendonly", "no", "--dir", workdir],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(500):
            with contextlib.suppress(redis.RedisError), redis.Redis(port=port) as client:
                client.ping()
                break
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


def kvtier_pass(store: Any, op: str, keys: list[bytes], views: list[Any], batch: int) -> float:
    """Seconds for one batched pass over every page (write or read); checks every page."""
    call = store.write if op == "write" else store.read_into
    start = time.perf_counter()
    for first in range(0, len(keys), batch):
        ok = call(keys[first:first + batch], views[first:first + batch])
        if not all(ok):
            raise RuntimeError(f"kvtier {op} failed for some pages: {ok}")
    return time.perf_counter() - start


def page_buffers(pages: int, page_bytes: int, batch: int, hot: bool) -> tuple[list[Any], list[Any]]:
    """(sources of the writes, destinations of the reads). ``hot``: 16 distinct sources and one
    batch of destinations, reused (cache-resident, as redis-benchmark's own value buffer is);
    otherwise every page has its own source and destination (a host pool larger than the
    caches). Both allocated and touched up front."""
    rng = np.random.default_rng(0)
    distinct = 16 if hot else pages
    sources = rng.integers(0, 256, (distinct, page_bytes), dtype=np.uint8)
    landing = np.ones((batch if hot else pages, page_bytes), dtype=np.uint8)
    return ([sources[i % distinct] for i in range(pages)],
            [landing[i % len(landing)] for i in range(pages)])


def check_round_trip(store: Any, keys: list[bytes], sources: list[Any], batch: int) -> None:
    probe = [np.zeros_like(sources[0]) for _ in range(min(batch, len(keys)))]
    if not all(store.read_into(keys[:len(probe)], probe)) or not all(
            np.array_equal(a, b) for a, b in zip(probe, sources, strict=False)):
        raise RuntimeError("kvtier read back different bytes")


def one_size(url: str, page_bytes: int, working_set: int, batch: int, rounds: int,
             hot: bool) -> dict[str, Any]:
    import hashlib

    pages = max(batch, working_set // page_bytes)
    sources, reads = page_buffers(pages, page_bytes, batch, hot)
    keys = [hashlib.sha256(b"bench-%d" % i).digest() for i in range(pages)]
    fill_keyspace(url, page_bytes, pages, batch)
    names = ("kvtier_write", "raw_write", "kvtier_read", "raw_read", "redis_py_write",
             "redis_py_read")
    gbps: dict[str, list[float]] = {name: [] for name in names}
    total = pages * page_bytes
    raw = {"requests": pages, "pipeline": batch, "keyspace": pages}
    with open_store(url, page_bytes=page_bytes, prefix="bench:", timeout_s=30) as store:
        for _ in range(rounds):
            gbps["kvtier_write"].append(total / kvtier_pass(store, "write", keys, sources, batch) / 1e9)
            gbps["raw_write"].append(run_redis_benchmark(url, "write", page_bytes, **raw).gbps)
            gbps["kvtier_read"].append(total / kvtier_pass(store, "read", keys, reads, batch) / 1e9)
            gbps["raw_read"].append(run_redis_benchmark(url, "read", page_bytes, **raw).gbps)
            for op in ("write", "read"):
                rate = redis_py_pipeline(url, op, page_bytes, pages=pages, batch=batch)
                gbps[f"redis_py_{op}"].append(rate.gbps)
        check_round_trip(store, keys, sources, batch)
    med = {name: statistics.median(values) for name, values in gbps.items()}
    return {"page_bytes": page_bytes, "pages": pages, "batch": batch, "threads": 1,
            "buffers": "hot" if hot else "pool", "rounds": rounds, "gbps_per_round": gbps,
            "read_gbps": med["kvtier_read"], "raw_read_gbps": med["raw_read"],
            "write_gbps": med["kvtier_write"], "raw_write_gbps": med["raw_write"],
            "redis_py_read_gbps": med["redis_py_read"], "redis_py_write_gbps": med["redis_py_write"],
            "read_ratio": med["kvtier_read"] / med["raw_read"],
            "write_ratio": med["kvtier_write"] / med["raw_write"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="An existing Redis (default: start one on loopback).")
    parser.add_argument("--sizes", default="64KiB:32,1MiB:8",
                        help="value size:pages per batch (= redis-benchmark -P), comma-separated")
    parser.add_argument("--working-set", default="128MiB", help="bytes of distinct pages per size")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per size")
    parser.add_argument("--buffers", choices=("hot", "pool", "both"), default="both",
                        help="hot: reused cache-resident page buffers (like redis-benchmark's); "
                        "pool: a distinct buffer per page")
    parser.add_argument("--out", help="write OUT.json and OUT.txt")
    args = parser.parse_args(argv)
    working_set = parse_size(args.working_set) or 128 << 20
    load_start = os.getloadavg()
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(own_server())
        runs = []
        modes = {"hot": [True], "pool": [False], "both": [True, False]}[args.buffers]
        for spec in args.sizes.split(","):
            size, _, batch = spec.partition(":")
            for hot in modes:
                runs.append(one_size(url, parse_size(size) or 0, working_set, int(batch or 32),
                                     args.rounds, hot))
    rows = [[r["page_bytes"], r["batch"], r["buffers"], r["write_gbps"], r["raw_write_gbps"],
             r["write_ratio"], r["read_gbps"], r["raw_read_gbps"], r["read_ratio"], r["redis_py_write_gbps"],
             r["redis_py_read_gbps"]] for r in runs]
    table = format_table(["value_bytes", "batch", "buffers", "kvtier_SET_GB/s", "rb_SET_GB/s", "SET_ratio",
                          "kvtier_GET_GB/s", "rb_GET_GB/s", "GET_ratio", "redis-py_SET_GB/s",
                          "redis-py_GET_GB/s"], rows)
    load = [round(x, 2) for x in (*load_start, *os.getloadavg())]
    note = (f"medians of {args.rounds} interleaved rounds, 1 connection each side; rb = "
            "redis-benchmark (-c 1, -P batch, -r pages) at the same value size; load average "
            f"(1/5/15 min) {load[:3]} at start, {load[3:]} at end")
    print(table)
    print(note)
    if args.out:
        write_report(f"{args.out}.json", "redis_store", {"note": note, "load_avg": load,
                                                          "runs": runs})
        with open(f"{args.out}.txt", "w") as fh:
            fh.write(table + "\n" + note + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
