"""Where the ``file://`` store's multi-threaded warm read loses to the raw read of the same bytes.

``disk_read_profile.py`` splits one thread's CPU time by stage; this runs the layers of the read
with ``--threads`` threads, as ``kvtier bench store`` does, and times them beside its raw baseline
in interleaved rounds (median of ``--rounds``), each pass reading every page once in batches of
``--batch`` pages (warm page cache):

    raw              os.preadv of each payload (``kvtier bench store``'s baseline)
    records          RecordIO.read_many, the record layer: one preadv per run of headers and one
                     of payloads, then the batch's checks (payload xxh3 included); descriptors
                     pinned beforehand, no index
    records_nohash   the same without the payload checksum
    records_ctypes   records with the payload xxh3 taken through ctypes (python-xxhash's own
                     ``XXH3_64bits_dispatch``, GIL released for each page) instead of
                     python-xxhash (which holds the GIL up to 64 KiB)
    store            FileStore.read_into: records plus the call's bookkeeping (buffer checks,
                     journal fstat, index lookups, pins, hot set, counters)
    store_nohash     the same with verify=header

For each it reports GB/s, read/raw (the median of the rounds' time ratios), the process's CPU
time per pass (user, system: 10 ms ticks) and its voluntary context switches per pass (threads
that blocked, on the GIL mostly). Main thread plus ``--threads`` readers.

    python benchmarks/probes/disk_read_threads.py --dir /var/tmp/kvtier-threads --page-bytes 64KiB,1MiB \
        --threads 2,4 --rounds 9 --json benchmarks/results/disk_read_threads.json
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import shutil
import statistics
import sys
import types
from collections.abc import Callable
from pathlib import Path

import xxhash
import xxhash._xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from disk_read_profile import fill_store
from kvtier.bench.page_io import aligned_pages, run_batches
from kvtier.bench.raw_disk import RawReads
from kvtier.machine import format_table, write_report
from kvtier.store.file import FileStore, segment
from kvtier.units import parse_size

VARIANTS = ("raw", "records", "records_nohash", "records_ctypes", "store", "store_nohash")


def ctypes_xxh3() -> Callable[[memoryview], int]:
    """xxh3_64 of a writable buffer through a ctypes call of the C function inside
    python-xxhash's extension (ctypes releases the GIL for the call)."""
    function = ctypes.CDLL(xxhash._xxhash.__file__).XXH3_64bits_dispatch
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    function.restype = ctypes.c_uint64
    from_buffer, address = ctypes.c_char.from_buffer, ctypes.addressof

    def digest(view: memoryview) -> int:
        anchor = from_buffer(view)  # holds the buffer while the call reads it
        return function(address(anchor), view.nbytes)

    probe = memoryview(bytearray(os.urandom(100_003)))
    for size in (1, 16, 17, 240, 241, 65536, 100_003):
        assert digest(probe[:size]) == xxhash.xxh3_64_intdigest(probe[:size])
    return digest


def passes(store: FileStore, keys: list[bytes], threads: int, batch: int,
           hits: list[int]) -> tuple[dict[str, Callable[[], float]], RawReads]:
    """One timed pass over every page per variant (seconds); ``hits[t]`` counts the pages that
    thread ``t`` read and verified (a variant that fails shows there, not only as speed)."""
    io = store.io
    dest = [aligned_pages(batch, store.page_bytes) for _ in range(threads)]
    locs, fds = store._pin(keys)  # held until the store closes
    raw = RawReads(store, keys, threads, batch)
    shim = types.SimpleNamespace(xxh3_64_intdigest=ctypes_xxh3())

    def read_records(t: int, ks: list[bytes], idx: range) -> None:
        found = io.read_many(locs[idx.start:idx.stop], fds, ks, dest[t][:len(ks)])[0]
        hits[t] += found.count(True)

    def read_store(t: int, ks: list[bytes], idx: range) -> None:
        hits[t] += store.read_into(ks, dest[t][:len(ks)]).count(True)

    def records() -> float:
        return run_batches(threads, keys, batch, read_records)

    def store_pass() -> float:
        return run_batches(threads, keys, batch, read_store)

    def without_hash(run: Callable[[], float]) -> Callable[[], float]:
        def timed() -> float:
            io.verify_payload = False
            try:
                return run()
            finally:
                io.verify_payload = True
        return timed

    def records_ctypes() -> float:
        segment.xxhash = shim  # the record layer's checksum module, for this pass only
        try:
            return records()
        finally:
            segment.xxhash = xxhash

    runs = dict(zip(VARIANTS, (raw.run, records, without_hash(records), records_ctypes,
                               store_pass, without_hash(store_pass)), strict=True))
    return runs, raw


def _measure(run: Callable[[], float]) -> dict[str, float]:
    times, usage = os.times(), resource.getrusage(resource.RUSAGE_SELF)
    seconds = run()
    after, used = os.times(), resource.getrusage(resource.RUSAGE_SELF)
    return {"wall_s": seconds, "user_s": after.user - times.user,
            "system_s": after.system - times.system,
            "voluntary_switches": used.ru_nvcsw - usage.ru_nvcsw}


def profile(root: Path, page_bytes: int, total: int, threads: int, batch: int,
            rounds: int) -> dict:
    pages = max(batch, total // page_bytes)
    store, keys = fill_store(root, page_bytes, pages, batch, threads, tag=b"threads")
    hits = [0] * threads
    try:
        runs, raw = passes(store, keys, threads, batch, hits)
        try:
            for run in runs.values():
                run()  # warm the page cache and the code paths
            samples: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
            for round_ in range(rounds):
                order = list(runs) if round_ % 2 == 0 else list(runs)[::-1]
                for name in order:
                    samples[name].append(_measure(runs[name]))
        finally:
            raw.close()
        if sum(hits) != pages * (rounds + 1) * (len(runs) - 1):
            raise RuntimeError(f"{sum(hits)} pages read and verified, expected "
                               f"{pages * (rounds + 1) * (len(runs) - 1)}")
        gb = pages * page_bytes / 1e9
        rows = {}
        for name, got in samples.items():
            ratios = [r["wall_s"] / s["wall_s"] for r, s in zip(samples["raw"], got, strict=True)]
            rows[name] = {"gbps": gb / statistics.median(s["wall_s"] for s in got),
                          "read_vs_raw": statistics.median(ratios),
                          **{key: statistics.median(s[key] for s in got) for key in got[0]}}
        return {"page_bytes": page_bytes, "pages": pages, "threads": threads, "batch": batch,
                "variants": rows, "load_avg": os.getloadavg()}
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--page-bytes", default="64KiB,1MiB")
    parser.add_argument("--total", default="1GiB")
    parser.add_argument("--threads", default="4", help="Thread counts, comma-separated.")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json")
    args = parser.parse_args()
    runs = [profile(Path(args.dir), parse_size(p), parse_size(args.total), int(t), args.batch,
                    args.rounds)
            for p in args.page_bytes.split(",") for t in args.threads.split(",")]
    headers = ["page", "thr", "variant", "GB/s", "read/raw", "user ms", "sys ms", "vol. switches"]
    table = [[r["page_bytes"], r["threads"], name, v["gbps"], v["read_vs_raw"],
              v["user_s"] * 1e3, v["system_s"] * 1e3, v["voluntary_switches"]]
             for r in runs for name, v in r["variants"].items()]
    print(f"warm reads, per pass over every page, median of {args.rounds} interleaved rounds")
    print(format_table(headers, table))
    print(f"load average: {os.getloadavg()}")
    if args.json:
        write_report(args.json, "disk_read_threads", {"rounds": args.rounds, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
