"""The server process's resident memory and file descriptors, for ``/metrics``.

Owns ``process_snapshot()``: ``resident_memory_bytes`` (from ``/proc/self/statm``),
``open_fds`` (entries of ``/proc/self/fd``) and ``max_fds`` (the soft ``RLIMIT_NOFILE``). A
value the platform does not tell (no ``/proc``: macOS) is left out. Any thread; reads only.
"""

from __future__ import annotations

import os
import resource
from typing import Any


def process_snapshot() -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        with open("/proc/self/statm") as statm:
            out["resident_memory_bytes"] = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        out["open_fds"] = len(os.listdir("/proc/self/fd"))
    except OSError:
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        out["max_fds"] = soft
    return out
