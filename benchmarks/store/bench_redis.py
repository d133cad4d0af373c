"""Redis store throughput beside redis-benchmark, side by side and interleaved in one run.

For each value size, every round runs, back to back on one server: kvtier's batched writes of
the whole working set, ``redis-benchmark -t set`` at the same value size, pipeline depth,
connection count (1: kvtier's calls run on one thread, one connection) and keyspace, kvtier's
batched reads, ``redis-benchmark -t get``, and the same bytes through a plain redis-py pipeline
(hiredis) as a second reference. Each sample moves the working set ``--passes`` times, so a
sample lasts long enough for scheduler noise to average out. Both sides' keys exist before the
first round (an untimed kvtier write pass; ``fill_keyspace`` for redis-benchmark), so every
timed SET overwrites a value of the same size.

Two statistics per ratio: the ratio of the medians over rounds, and the median over rounds of
the ratio within a round (kvtier and redis-benchmark ran seconds apart, under the same load from
other processes, so the paired ratio is the steadier one on a shared machine). CPU seconds per
request of each client are measured too (``getrusage``: kvtier's own process; redis-benchmark as
a child process, less its start-up cost measured with ``-n 1``): they do not depend on load.

Buffers: ``hot`` reuses one batch of destination buffers and 16 sources (cache-resident, as
redis-benchmark's own buffers are: the like-for-like comparison); ``pool`` gives every page its
own source and destination (a host pool larger than the caches, as a serving engine has).
Without ``--url`` it starts its own ``redis-server`` on a free loopback port and stops it at the
end. Main thread only.

    python benchmarks/store/bench_redis.py --rounds 11 --out benchmarks/results/redis_store
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import io
import os
import resource
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvtier.bench.raw_redis import benchmark_args, fill_keyspace, redis_py_pipeline
from kvtier.machine import format_table, write_report
from kvtier.store import open_store
from kvtier.units import parse_size

_TESTS = {"write": "SET", "read": "GET"}

#: What is the same on both sides of a ratio, and what is not (for the report).
LIKE_FOR_LIKE = {
    "same": "server, value size (-d = page bytes), requests per sample (-n = passes x pages), "
            "pipeline depth (-P = pages per kvtier call; each side waits for a batch's replies "
            "before sending the next), connections (-c 1 = kvtier's one calling thread), "
            "keyspace (-r = pages), and for SETs an existing value of that size is overwritten",
    "differs": "kvtier's values carry a 64-byte record header (moved but not counted) and its "
               "keys are 70 bytes (prefix + hex) against 16; kvtier visits keys in order, "
               "redis-benchmark at random over the keyspace; redis-benchmark SETs one constant "
               "value and reads replies into its own reused buffers, which buffers=hot mirrors "
               "(buffers=pool: a distinct source and destination per page)",
}


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


def cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def redis_benchmark_argv(url: str, op: str, value_bytes: int, *, requests: int, pipeline: int,
                         keyspace: int) -> list[str]:
    """The exact redis-benchmark command a sample runs (1 connection, like kvtier's caller)."""
    return ["redis-benchmark", *benchmark_args(url), "-t", _TESTS[op].lower(),
            "-d", str(value_bytes), "-n", str(requests), "-c", "1", "-P", str(pipeline),
            "-r", str(keyspace), "--csv", "-q"]


def shown(argv: list[str]) -> str:
    """A command line for the report, with any password (``-a``) hidden."""
    return " ".join("***" if i and argv[i - 1] == "-a" else arg for i, arg in enumerate(argv))


def run_redis_benchmark(argv: list[str], op: str) -> tuple[float, float]:
    """(requests per second redis-benchmark reports, CPU seconds its process used)."""
    before = cpu_seconds(resource.RUSAGE_CHILDREN)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=True)
    cpu = cpu_seconds(resource.RUSAGE_CHILDREN) - before
    for row in csv.reader(io.StringIO(done.stdout)):
        if row and row[0] == _TESTS[op]:
            return float(row[1]), cpu
    raise RuntimeError(f"redis-benchmark printed no {_TESTS[op]} result: {done.stdout[-300:]}")


def kvtier_pass(store: Any, op: str, keys: list[bytes], views: list[Any], batch: int,
                passes: int) -> tuple[float, float]:
    """(seconds, CPU seconds) for ``passes`` batched passes over every page; checks every page."""
    call = store.write if op == "write" else store.read_into
    cpu = cpu_seconds(resource.RUSAGE_SELF)
    start = time.perf_counter()
    for _ in range(passes):
        for first in range(0, len(keys), batch):
            ok = call(keys[first:first + batch], views[first:first + batch])
            if not all(ok):
                raise RuntimeError(f"kvtier {op} failed for some pages: {ok}")
    return time.perf_counter() - start, cpu_seconds(resource.RUSAGE_SELF) - cpu


def page_buffers(pages: int, page_bytes: int, batch: int, hot: bool) -> tuple[list[Any], list[Any]]:
    """(sources of the writes, destinations of the reads), allocated and touched up front."""
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


def start_up_cpu(url: str) -> float:
    """CPU seconds redis-benchmark spends outside its requests (start, CONFIG GET, exit)."""
    argv = redis_benchmark_argv(url, "read", 16, requests=1, pipeline=1, keyspace=1)
    return min(run_redis_benchmark(argv, "read")[1] for _ in range(3))


def one_size(url: str, page_bytes: int, working_set: int, batch: int, rounds: int, passes: int,
             hot: bool, rb_start_cpu: float) -> dict[str, Any]:
    pages = max(batch, working_set // page_bytes)
    sources, reads = page_buffers(pages, page_bytes, batch, hot)
    keys = [hashlib.sha256(b"bench-%d" % i).digest() for i in range(pages)]
    fill_keyspace(url, page_bytes, pages, batch)
    requests = pages * passes
    argv = {op: redis_benchmark_argv(url, op, page_bytes, requests=requests, pipeline=batch,
                                     keyspace=pages) for op in _TESTS}
    gbps: dict[str, list[float]] = {}
    cpu_us: dict[str, list[float]] = {}

    def record(name: str, rate: float, cpu_s: float | None = None) -> None:
        gbps.setdefault(name, []).append(rate * page_bytes / 1e9)
        if cpu_s is not None:
            cpu_us.setdefault(name, []).append(cpu_s / requests * 1e6)

    with open_store(url, page_bytes=page_bytes, prefix="bench:", timeout_s=30) as store:
        kvtier_pass(store, "write", keys, sources, batch, 1)  # rb's keys exist too: overwrite
        for _ in range(rounds):
            for op, views in (("write", sources), ("read", reads)):
                seconds, cpu = kvtier_pass(store, op, keys, views, batch, passes)
                record(f"kvtier_{op}", requests / seconds, cpu)
                rate, cpu = run_redis_benchmark(argv[op], op)
                record(f"raw_{op}", rate, max(cpu - rb_start_cpu, 0.0))
            for op in ("write", "read"):
                rate = redis_py_pipeline(url, op, page_bytes, pages=pages, batch=batch)
                record(f"redis_py_{op}", rate.requests_per_s)
        check_round_trip(store, keys, sources, batch)
    med = {name: statistics.median(values) for name, values in gbps.items()}
    out: dict[str, Any] = {
        "page_bytes": page_bytes, "pages": pages, "batch": batch, "threads": 1, "connections": 1,
        "passes": passes, "buffers": "hot" if hot else "pool", "rounds": rounds,
        "redis_benchmark_argv": {op: shown(cmd) for op, cmd in argv.items()},
        "gbps_per_round": gbps, "cpu_us_per_request_per_round": cpu_us}
    for op, short in (("read", "read"), ("write", "write")):
        paired = [k / r for k, r in zip(gbps[f"kvtier_{op}"], gbps[f"raw_{op}"], strict=True)]
        out.update({f"{short}_gbps": med[f"kvtier_{op}"], f"raw_{short}_gbps": med[f"raw_{op}"],
                    f"redis_py_{short}_gbps": med[f"redis_py_{op}"],
                    f"{short}_ratio": med[f"kvtier_{op}"] / med[f"raw_{op}"],
                    f"{short}_ratio_paired": statistics.median(paired),
                    f"{short}_cpu_us": statistics.median(cpu_us[f"kvtier_{op}"]),
                    f"raw_{short}_cpu_us": statistics.median(cpu_us[f"raw_{op}"])})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="An existing Redis (default: start one on loopback).")
    parser.add_argument("--sizes", default="64KiB:32,1MiB:8",
                        help="value size:pages per batch (= redis-benchmark -P), comma-separated")
    parser.add_argument("--working-set", default="128MiB", help="bytes of distinct pages per size")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per size")
    parser.add_argument("--passes", type=int, default=2,
                        help="passes over the working set per sample (redis-benchmark -n)")
    parser.add_argument("--buffers", choices=("hot", "pool", "both"), default="both",
                        help="hot: reused cache-resident page buffers (like redis-benchmark's); "
                        "pool: a distinct buffer per page")
    parser.add_argument("--out", help="write OUT.json and OUT.txt (a trailing .json is dropped)")
    args = parser.parse_args(argv)
    working_set = parse_size(args.working_set) or 128 << 20
    load_start = os.getloadavg()
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(own_server())
        rb_start_cpu = start_up_cpu(url)
        runs = []
        modes = {"hot": [True], "pool": [False], "both": [True, False]}[args.buffers]
        for spec in args.sizes.split(","):
            size, _, batch = spec.partition(":")
            for hot in modes:
                runs.append(one_size(url, parse_size(size) or 0, working_set, int(batch or 32),
                                     args.rounds, args.passes, hot, rb_start_cpu))
    rows = [[r["page_bytes"], r["batch"], r["buffers"], r["write_gbps"], r["raw_write_gbps"],
             r["write_ratio"], r["write_ratio_paired"], r["read_gbps"], r["raw_read_gbps"],
             r["read_ratio"], r["read_ratio_paired"], r["write_cpu_us"], r["raw_write_cpu_us"],
             r["read_cpu_us"], r["raw_read_cpu_us"], r["redis_py_write_gbps"],
             r["redis_py_read_gbps"]] for r in runs]
    table = format_table(["value_bytes", "batch", "buffers", "kvtier_SET_GB/s", "rb_SET_GB/s",
                          "SET_ratio", "SET_paired", "kvtier_GET_GB/s", "rb_GET_GB/s",
                          "GET_ratio", "GET_paired", "kvtier_SET_cpu_us", "rb_SET_cpu_us",
                          "kvtier_GET_cpu_us", "rb_GET_cpu_us", "redis-py_SET_GB/s",
                          "redis-py_GET_GB/s"], rows)
    load = [round(x, 2) for x in (*load_start, *os.getloadavg())]
    note = (f"medians of {args.rounds} interleaved rounds, {args.passes} passes over the working "
            "set per sample, 1 connection each side; rb = redis-benchmark -c 1 -P batch "
            "-r pages -n passes*pages -d value_bytes (commands in the JSON); ratio = ratio of "
            "medians, paired = median of per-round ratios; cpu_us = client CPU (user+sys) per "
            f"request (rb less {rb_start_cpu * 1e3:.1f} ms start-up); load average (1/5/15 min) "
            f"{load[:3]} at start, {load[3:]} at end")
    print(table)
    print(note)
    if args.out:
        out = args.out.removesuffix(".json")
        write_report(f"{out}.json", "redis_store",
                     {"note": note, "like_for_like": LIKE_FOR_LIKE, "load_avg": load,
                      "rb_start_up_cpu_s": rb_start_cpu, "runs": runs})
        with open(f"{out}.txt", "w") as fh:
            fh.write(table + "\n" + note + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
