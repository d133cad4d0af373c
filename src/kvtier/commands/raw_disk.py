"""Raw disk baseline of ``kvtier bench store`` for ``file://`` stores (``RAW_BASELINES["file"]``).

Reads: a plain ``os.preadv`` of each page's payload bytes at its place in the store's own segment
files, into page-aligned buffers, with the same threads and batches as the store run: the same
bytes on the same disk, without index lookups, headers or checksums. Writes: the same pages
written sequentially with ``os.pwritev`` into one new file per thread in the store directory,
then ``fdatasync`` of each (the store's write time includes the same flush of its files). Runs
on the benchmark's main thread and its worker threads.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from typing import Any

from kvtier.commands.bench_store import aligned_pages, drop_caches, run_batches
from kvtier.store.base import PageStore


def measure(url: str, *, store: PageStore, keys: Sequence[bytes], sources: Sequence[memoryview],
            threads: int, batch: int, cold: bool, repeats: int) -> dict[str, Any]:
    """Raw read and write rates of the bytes the store benchmark moved (see bench_store)."""
    from kvtier.store.file import FileStore
    from kvtier.store.file_tools import payload_locations

    if not isinstance(store, FileStore):
        raise TypeError("the raw disk baseline needs a file:// store")
    gb = len(keys) * store.page_bytes / 1e9
    read_s = _raw_read(store, payload_locations(store, keys), threads, batch, cold, repeats)
    write_s, sync_s = _raw_write(store, len(keys), sources, threads, batch)
    return {"raw_read_gbps": gb / read_s, "raw_write_gbps": gb / (write_s + sync_s),
            "raw_write_buffered_gbps": gb / write_s,
            "raw_method": "os.preadv of each payload in the store's segment files; os.pwritev "
                          "of the same pages to one new file per thread, then fdatasync"}


def _raw_read(store: PageStore, locations: list, threads: int, batch: int, cold: bool,
              repeats: int) -> float:
    if any(loc is None for loc in locations):
        raise RuntimeError("some benchmark pages are no longer in the store (evicted?)")
    fds = {path: os.open(path, os.O_RDONLY) for path in {p for p, _ in locations}}
    plan = [(fds[path], offset) for path, offset in locations]
    dest = [aligned_pages(batch, store.page_bytes) for _ in range(threads)]

    def read(t: int, ks: Sequence[bytes], idx: range) -> None:
        buffers = dest[t]
        for j, i in enumerate(idx):
            fd, offset = plan[i]
            os.preadv(fd, [buffers[j]], offset)

    keys = list(range(len(plan)))  # run_batches only needs something to count
    try:
        if not cold:
            run_batches(threads, keys, batch, read)
        best = float("inf")
        for _ in range(repeats):
            if cold:
                drop_caches()
            best = min(best, run_batches(threads, keys, batch, read))
        return best
    finally:
        for fd in fds.values():
            os.close(fd)


def _raw_write(store: Any, pages: int, sources: Sequence[memoryview], threads: int,
               batch: int) -> tuple[float, float]:
    scratch = store.root / "raw-write"
    scratch.mkdir(exist_ok=True)
    fds = [os.open(scratch / f"{t}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
           for t in range(threads)]
    positions = [0] * threads
    page_bytes = store.page_bytes

    def write(t: int, ks: Sequence[int], idx: range) -> None:
        for i in idx:
            os.pwritev(fds[t], [sources[i % len(sources)]], positions[t])
            positions[t] += page_bytes

    try:
        write_s = run_batches(threads, list(range(pages)), batch, write)
        begin = time.perf_counter()
        for fd in fds:
            os.fdatasync(fd)
        sync_s = time.perf_counter() - begin
    finally:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(scratch, ignore_errors=True)
    return write_s, sync_s
