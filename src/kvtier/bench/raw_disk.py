"""Raw disk baseline of ``kvtier bench store`` for ``file://`` stores (``RAW_BASELINES["file"]``).

Reads: a plain ``os.preadv`` of each page's payload bytes at its place in the store's own segment
files, into page-aligned buffers, with the same threads and batches as the store run: the same
bytes on the same disk in the same order, without index lookups, headers or checksums (one
system call per page: the plain way; the store itself reads a run of adjacent records with one
call). Writes: the same pages written sequentially with ``os.pwritev`` into one new file per
thread in the store directory, then ``fdatasync`` of each (the store's write time includes the
same flush of its files).

Besides ``measure`` (the contract of ``store_throughput``), this module offers one pass at a time
(``RawReads``, ``write_pass``), so that the benchmark interleaves raw and store passes round by
round on a shared machine. Runs on the benchmark's main thread and its worker threads.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from typing import Any

from kvtier.bench.page_io import aligned_pages, drop_caches, run_batches
from kvtier.store.base import PageStore

METHOD = ("os.preadv of each payload in the store's segment files; os.pwritev of the same pages "
          "to one new file per thread, then fdatasync")


class RawReads:
    """Timed raw read passes over the payloads of ``keys`` in ``store``'s segment files."""

    def __init__(self, store: PageStore, keys: Sequence[bytes], threads: int, batch: int) -> None:
        from kvtier.store.file import FileStore
        from kvtier.store.file.tools import payload_locations

        if not isinstance(store, FileStore):
            raise TypeError("the raw disk baseline needs a file:// store")
        locations = payload_locations(store, keys)
        if any(loc is None for loc in locations):
            raise RuntimeError("some benchmark pages are no longer in the store (evicted?)")
        self.fds = {path: os.open(path, os.O_RDONLY) for path in {p for p, _ in locations}}  # type: ignore[misc]
        self.plan = [(self.fds[path], offset) for path, offset in locations]  # type: ignore[misc]
        self.dest = [aligned_pages(batch, store.page_bytes) for _ in range(threads)]
        self.threads, self.batch = threads, batch

    def run(self) -> float:
        """One pass over every page; seconds taken."""
        plan, dest = self.plan, self.dest

        def read(t: int, ks: Sequence[int], idx: range) -> None:
            buffers = dest[t]
            for j, i in enumerate(idx):
                fd, offset = plan[i]
                os.preadv(fd, [buffers[j]], offset)

        return run_batches(self.threads, list(range(len(plan))), self.batch, read)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def write_pass(store: Any, pages: int, sources: Sequence[memoryview], threads: int,
               batch: int) -> tuple[float, float]:
    """Write ``pages`` pages the plain way and flush them; (write seconds, flush seconds)."""
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


def measure(url: str, *, store: PageStore, keys: Sequence[bytes], sources: Sequence[memoryview],
            threads: int, batch: int, cold: bool, repeats: int) -> dict[str, Any]:
    """Raw read and write rates of the bytes the store benchmark moved (see store_throughput)."""
    gb = len(keys) * store.page_bytes / 1e9
    reads = RawReads(store, keys, threads, batch)
    try:
        if not cold:
            reads.run()
        best = float("inf")
        for _ in range(repeats):
            if cold:
                drop_caches()
            best = min(best, reads.run())
    finally:
        reads.close()
    write_s, sync_s = write_pass(store, len(keys), sources, threads, batch)
    return {"raw_read_gbps": gb / best, "raw_write_gbps": gb / (write_s + sync_s),
            "raw_write_buffered_gbps": gb / write_s, "raw_method": METHOD}
