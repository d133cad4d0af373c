"""The store benchmark behind ``kvtier bench store``: a page store's write, contains and read
throughput beside a raw baseline of the same bytes on the same device, measured in the same run.

Owns ``run`` (every page size x thread count x warm/cold run, the table and the JSON report),
``bench_one`` (one such run) and ``RAW_BASELINES``. Each run opens a fresh store location (a
subdirectory for ``file://``), writes the pages with ``threads`` writer threads (``batch``
pages per call), flushes its files to disk (``fdatasync``), times ``contains`` over 100k
lookups, reads everything back into page-aligned buffers (cold runs drop the page cache first,
as root), reopens the store (open time), and has the scheme's raw baseline move the same bytes.
The table and JSON report pages/s and GB/s; the last line printed is the worst read/raw ratio.
Main thread plus workers.

A baseline module that also offers single passes (``RawReads`` with ``run()`` and ``close()``,
and ``write_pass``, as ``raw_disk`` does) is measured side by side with the store, as a shared
machine needs: a raw write pass just before and just after the store's writes (their mean is
the raw rate), and ``repeats`` rounds of one store read pass and one raw read pass, taking
turns at going first; read rates are the medians of the passes, read/raw the median of the
rounds' ratios. Other baselines run after the store's reads, best of ``repeats`` each.

Raw baselines, one per URL scheme, are named in ``RAW_BASELINES`` and imported on first use (a
missing module fails only its own scheme). Each is a function::

    def measure(url: str, *, store: PageStore, keys: Sequence[bytes],
                sources: Sequence[memoryview], threads: int, batch: int, cold: bool,
                repeats: int) -> dict[str, Any]:
        '''Move the bytes the store benchmark just moved, the plain way, and time it.

        Called after the store phases, with ``store`` open and holding ``keys``; page ``i``
        holds ``sources[i % len(sources)]`` (``store.page_bytes`` each). Use ``threads``
        threads and ``batch`` pages per call, without kvtier's index, headers or checksums
        (disk: ``os.preadv``/``pwritev`` over files; Redis: pipelined GET/SET). ``cold``: drop
        caches before each read where possible (``page_io.drop_caches``). Return at least
        ``raw_write_gbps`` (including a flush to the device), ``raw_read_gbps`` (best of
        ``repeats``)
        and ``raw_method`` (one line saying what was timed); other keys go into the JSON.
        '''
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvtier.bench.page_io import (
    SOURCE_PAGES,
    aligned_pages,
    drop_caches,
    run_batches,
    source_pages,
)
from kvtier.errors import ConfigError
from kvtier.machine import format_table, write_report

RAW_BASELINES: dict[str, str] = {
    "file": "kvtier.bench.raw_disk:measure",
    "redis": "kvtier.bench.raw_redis:measure",
    "rediss": "kvtier.bench.raw_redis:measure",
}
CONTAINS_LOOKUPS = 100_000


def _store_dir(url: str) -> Path | None:
    """A ``file://`` URL's directory (refused unless absolute and local); None otherwise."""
    if urlsplit(url).scheme != "file":
        return None
    from kvtier.store.file.options import file_url_path

    return file_url_path(url)


def flush_files(url: str) -> None:
    """fdatasync every file of a ``file://`` store (not ``os.sync()``: that would also wait
    for whatever else the machine has dirty)."""
    root = _store_dir(url)
    if root is None:
        return
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)


def raw_baseline(scheme: str) -> Callable[..., dict[str, Any]]:
    module, _, name = RAW_BASELINES[scheme].partition(":")
    return getattr(importlib.import_module(module), name)


def _fresh_location(url: str, page_bytes: int) -> tuple[str, Callable[[], None]]:
    root = _store_dir(url)
    if root is None:
        return url, lambda: None
    path = root / f"bench-{page_bytes}-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    return (urlunsplit(urlsplit(url)._replace(path=str(path))),
            lambda: shutil.rmtree(path, ignore_errors=True))


def bench_one(url: str, page_bytes: int, pages: int, threads: int, batch: int, cold: bool,
              repeats: int) -> dict[str, Any]:
    from kvtier.store import open_store

    run_url, cleanup = _fresh_location(url, page_bytes)
    nonce = os.urandom(8)
    keys = [hashlib.sha256(nonce + i.to_bytes(8, "little")).digest() for i in range(pages)]
    sources = source_pages(page_bytes)
    gb = pages * page_bytes / 1e9
    baseline = raw_baseline(urlsplit(url).scheme)
    module = importlib.import_module(baseline.__module__)
    paired = all(hasattr(module, name) for name in ("RawReads", "write_pass"))
    store = open_store(run_url, page_bytes=page_bytes)
    try:
        raw_writes = []
        if paired:  # raw writes just before and just after the store's
            raw_writes.append(sum(module.write_pass(store, pages, sources, threads, batch)))
        refused = [0] * threads  # one counter per thread: no shared read-modify-write

        def write(t: int, ks: Sequence[bytes], idx: range) -> None:
            refused[t] += store.write(ks, [sources[i % SOURCE_PAGES] for i in idx]).count(False)

        write_s = run_batches(threads, keys, batch, write)
        sync_start = time.perf_counter()
        flush_files(run_url)
        sync_s = time.perf_counter() - sync_start
        if paired:
            raw_writes.append(sum(module.write_pass(store, pages, sources, threads, batch)))
        lookups = (keys * (CONTAINS_LOOKUPS // max(1, pages) + 1))[:CONTAINS_LOOKUPS]
        contains_start = time.perf_counter()
        present = sum(store.contains(lookups))
        contains_s = time.perf_counter() - contains_start
        if paired:
            reads = _paired_reads(store, keys, threads, batch, cold, repeats,
                                  module.RawReads(store, keys, threads, batch))
            raw = {"raw_read_gbps": gb / statistics.median(reads["raw_read_s"]),
                   "raw_write_gbps": gb / statistics.mean(raw_writes),
                   "raw_write_s": raw_writes, "raw_method": module.METHOD + "; interleaved "
                   "with the store's passes, round by round"}
            read_s, ratio = statistics.median(reads["read_s"]), reads["read_vs_raw"]
        else:
            read_s, dropped, misses = _read_phase(store, keys, threads, batch, cold, repeats)
            reads = {"caches_dropped": dropped, "read_misses": misses}
            raw = baseline(run_url, store=store, keys=keys, sources=sources, threads=threads,
                           batch=batch, cold=cold, repeats=repeats)
            ratio = (gb / read_s) / raw["raw_read_gbps"]
        open_s = _reopen_seconds(store, run_url, page_bytes)
        if urlsplit(url).scheme != "file":
            store.delete(keys)
    finally:
        store.close()
        cleanup()
    return {"page_bytes": page_bytes, "pages": pages, "threads": threads, "batch": batch,
            "cold": cold, "write_refused": sum(refused), **reads,
            "contains_present": present,
            "write_gbps": gb / (write_s + sync_s), "write_buffered_gbps": gb / write_s,
            "write_pages_per_s": pages / (write_s + sync_s),
            "read_gbps": gb / read_s, "read_pages_per_s": pages / read_s,
            "contains_ms_per_100k": contains_s * 1e3 * CONTAINS_LOOKUPS / len(lookups),
            "open_s": open_s, **raw, "read_vs_raw": ratio,
            "write_vs_raw": (gb / (write_s + sync_s)) / raw["raw_write_gbps"],
            "load_avg": os.getloadavg()}


def _paired_reads(store: Any, keys: list[bytes], threads: int, batch: int, cold: bool,
                  repeats: int, raw: Any) -> dict[str, Any]:
    """``repeats`` rounds of one store read pass and one raw read pass of the same bytes,
    taking turns at going first (cold: the page cache dropped before each pass). The ratio
    is the median of the rounds' raw/store time ratios."""
    dest = [aligned_pages(batch, store.page_bytes) for _ in range(threads)]
    misses = [0] * threads

    def read(t: int, ks: Sequence[bytes], idx: range) -> None:
        misses[t] += store.read_into(ks, dest[t][:len(ks)]).count(False)

    def store_pass() -> float:
        return run_batches(threads, keys, batch, read)

    passes = {"read_s": store_pass, "raw_read_s": raw.run}
    times: dict[str, list[float]] = {name: [] for name in passes}
    dropped = False
    try:
        if not cold:
            for run in passes.values():
                run()  # fill the page cache
        for round_ in range(repeats):
            for name in (list(passes) if round_ % 2 == 0 else list(passes)[::-1]):
                if cold:
                    dropped = drop_caches()
                times[name].append(passes[name]())
    finally:
        raw.close()
    ratios = [r / s for r, s in zip(times["raw_read_s"], times["read_s"], strict=True)]
    return {**times, "read_vs_raw_rounds": ratios, "read_vs_raw": statistics.median(ratios),
            "caches_dropped": dropped, "read_misses": sum(misses)}


def _read_phase(store: Any, keys: list[bytes], threads: int, batch: int, cold: bool,
                repeats: int) -> tuple[float, bool, int]:
    dest = [aligned_pages(batch, store.page_bytes) for _ in range(threads)]
    misses = [0] * threads

    def read(t: int, ks: Sequence[bytes], idx: range) -> None:
        misses[t] += store.read_into(ks, dest[t][:len(ks)]).count(False)

    dropped = False
    if not cold:
        run_batches(threads, keys, batch, read)  # fill the page cache
    best = float("inf")
    for _ in range(repeats):
        if cold:
            dropped = drop_caches()
        best = min(best, run_batches(threads, keys, batch, read))
    return best, dropped, sum(misses)


def _reopen_seconds(store: Any, url: str, page_bytes: int) -> float | None:
    from kvtier.store import open_store

    if urlsplit(url).scheme != "file":
        return None
    store.close()
    begin = time.perf_counter()
    reopened = open_store(url, page_bytes=page_bytes)
    seconds = time.perf_counter() - begin
    reopened.close()
    return seconds


def run(url: str, *, page_sizes: Sequence[int], pages: int | None, total: int | None,
        thread_counts: Sequence[int], batch: int, cache: str, repeats: int,
        json_path: str | None) -> int:
    """Every run of ``page_sizes`` x ``thread_counts`` x ``cache`` (warm, cold or both), each of
    ``pages`` pages (or ``total`` bytes of pages); prints the table and the worst read/raw
    ratio, writes JSON to ``json_path``. Returns the exit status (0)."""
    modes = {"warm": [False], "cold": [True], "both": [False, True]}[cache]
    runs = []
    _store_dir(url)  # a file:// URL that names no local directory fails here, first
    for page_bytes in page_sizes:
        count = pages or (total or 0) // page_bytes
        if count < 1:
            raise ConfigError("--total", total, f"at least one page of {page_bytes} bytes")
        for threads in thread_counts:
            for cold in modes:
                runs.append(bench_one(url, page_bytes, count, threads, batch, cold, repeats))
    headers = ["page", "thr", "cache", "pages", "write GB/s", "raw write", "read GB/s",
               "raw read", "read/raw", "write/raw", "contains ms/100k", "open s"]
    rows = [[r["page_bytes"], r["threads"], "cold" if r["cold"] else "warm", r["pages"],
             r["write_gbps"], r["raw_write_gbps"], r["read_gbps"], r["raw_read_gbps"],
             r["read_vs_raw"], r["write_vs_raw"], r["contains_ms_per_100k"],
             r["open_s"] if r["open_s"] is not None else "-"] for r in runs]
    print(format_table(headers, rows))
    if any(r["cold"] and not r["caches_dropped"] for r in runs):
        print("note: could not drop the page cache (not root): 'cold' reads were warm")
    if json_path:
        write_report(json_path, "store", {"url": url, "runs": runs})
    print(f"read/raw: {min(r['read_vs_raw'] for r in runs):.3f}")
    return 0
