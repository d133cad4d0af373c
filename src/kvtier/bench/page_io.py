"""Page buffers and threaded batches for the store benchmark and its raw baselines.

Owns ``aligned_pages`` (page buffers carved from one page-aligned mapping), ``source_pages``
(``SOURCE_PAGES`` such buffers of distinct, reproducible bytes to write), ``run_batches`` (a
list of keys split into batches dealt round-robin to worker threads, timed) and
``drop_caches`` (flush and drop the kernel page cache, as root). Used by ``store_throughput``,
``raw_disk`` and scripts under ``benchmarks/``. Runs on the caller's thread and the worker
threads ``run_batches`` starts.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

K = TypeVar("K")

#: Distinct source pages a benchmark writes, page ``i`` holding source ``i % SOURCE_PAGES``.
SOURCE_PAGES = 16


def drop_caches() -> bool:
    """Flush and drop the kernel page cache (needs root); True when it worked."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def aligned_pages(count: int, page_bytes: int) -> list[memoryview]:
    """``count`` page buffers carved from one page-aligned mapping."""
    stride = -(-page_bytes // 4096) * 4096
    block = memoryview(mmap.mmap(-1, max(1, count) * stride))
    return [block[i * stride:i * stride + page_bytes] for i in range(count)]


def run_batches(threads: int, keys: Sequence[K], batch: int,
                call: Callable[[int, Sequence[K], range], Any]) -> float:
    """Split ``keys`` into batches dealt round-robin to ``threads`` threads; seconds taken.
    ``call(thread, batch_keys, batch_indexes)`` does one batch."""
    starts = list(range(0, len(keys), batch))

    def work(t: int) -> None:
        for start in starts[t::threads]:
            end = min(start + batch, len(keys))
            call(t, keys[start:end], range(start, end))

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    begin = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - begin


def source_pages(page_bytes: int) -> list[memoryview]:
    """``SOURCE_PAGES`` page-aligned buffers of distinct, reproducible bytes to write."""
    pages = aligned_pages(SOURCE_PAGES, page_bytes)
    for i, page in enumerate(pages):
        seed = hashlib.sha256(b"kvtier-bench-%d" % i).digest()
        page[:] = (seed * (page_bytes // 32 + 1))[:page_bytes]
    return pages
