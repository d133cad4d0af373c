"""The disk's own read speed under a store directory: the floor under a disk hit on this machine.

Owns ``raw_read``: every file under a directory read once with ``O_DIRECT`` (the page cache
bypassed) by a few threads in 16 MiB chunks, so a disk hit's time can be set beside the time
the device itself needs for the same bytes; and ``evict``: the same files flushed and dropped
from the OS page cache (``posix_fadvise(DONTNEED)``, no privileges needed), so that a disk hit
in a fresh process reads the disk rather than memory the writing process left behind (kvtier's
disk tier reads through the page cache unless its ``direct`` option is on). ``vllm_gpu.py``'s
parent calls both around the disk cases, on its main thread (the readers are its own threads).
"""

from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

CHUNK = 16 << 20
THREADS = 8


def _read_file(path: Path) -> int:
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, flags)
    except OSError:                       # a file system without O_DIRECT
        fd = os.open(path, os.O_RDONLY)
    buf = mmap.mmap(-1, CHUNK)            # page-aligned, as O_DIRECT wants
    done = 0
    try:
        while True:
            n = os.preadv(fd, [buf], done)
            done += n
            if n < CHUNK:
                return done
    finally:
        os.close(fd)
        buf.close()


def raw_read(root: Path, threads: int = THREADS) -> dict[str, Any]:
    """Bytes under ``root``, the seconds to read them all once, and GB/s (None when empty)."""
    files = sorted(p for p in Path(root).rglob("*") if p.is_file())
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(_read_file, files))
    seconds = time.perf_counter() - started
    return {"files": len(files), "bytes": total, "seconds": round(seconds, 3),
            "gb_s": round(total / seconds / 1e9, 2) if total and seconds > 0 else None,
            "threads": threads, "o_direct": hasattr(os, "O_DIRECT")}


def evict(root: Path) -> dict[str, Any]:
    """Write back and drop every file under ``root`` from the page cache; returns the files
    and bytes asked for (the kernel may keep pages another process has locked or mapped)."""
    files, total = 0, 0
    for path in sorted(p for p in Path(root).rglob("*") if p.is_file()):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)                  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            files, total = files + 1, total + os.fstat(fd).st_size
        finally:
            os.close(fd)
    return {"files": files, "bytes": total}
