"""The rate probes behind ``kvtier plan --probe``: measure the rates the planner needs here.

Owns three short probes, each moving ``nbytes``: host (pinned host-to-device copies when CUDA is
present, else host memory copies), disk (page-sized writes with fsync, then reads that bypass the
page cache with O_DIRECT where the filesystem allows it) and remote (pipelined SET/GET of
page-sized values against the configured Redis, keys removed afterwards). Results are bytes per
second and seconds, keyed like the ``kvtier plan`` rate flags. Main thread; imports torch and
redis lazily.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kvtier.config import KvtierConfig

_CHUNK = 4 << 20  # bytes per probe IO: a page of a mid-size model
_ALIGN = 4096


def probe_all(config: KvtierConfig, nbytes: int, probe_dir: str = "") -> dict[str, float]:
    """Every probe that applies to ``config``; keys match the ``kvtier plan`` flags."""
    out = {"host-bw": probe_host(nbytes)}
    directory = probe_dir or _disk_dir(config.store.disk_url) or tempfile.gettempdir()
    out.update(probe_disk(Path(directory), nbytes))
    if config.store.remote_url:
        out.update(probe_remote(config.store.remote_url, nbytes, config.store.remote_timeout_s))
    return out


def _disk_dir(url: str) -> str:
    if not url:
        return ""
    parsed = urlparse(url)
    return parsed.path if parsed.scheme == "file" else ""


def _best_rate(nbytes: int, fn: Any, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def probe_host(nbytes: int) -> float:
    """Host-to-device bytes/s from pinned memory if CUDA is present, else host memcpy bytes/s."""
    import torch

    from kvtier.memory import PinnedBudget, allocate_host_bytes

    with allocate_host_bytes(PinnedBudget(nbytes), "probe", nbytes) as host:
        src = host.tensor
        src.fill_(1)
        if torch.cuda.is_available():
            dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

            def copy() -> None:
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize()
        else:
            dst = torch.empty_like(src)

            def copy() -> None:
                dst.copy_(src)

        copy()
        return _best_rate(nbytes, copy)


def _aligned_buffer(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, max(nbytes, _ALIGN))  # anonymous maps start on a page boundary


def probe_disk(directory: Path, nbytes: int) -> dict[str, float]:
    """Write with fsync, then read back (O_DIRECT when allowed); bytes/s and read latency."""
    directory.mkdir(parents=True, exist_ok=True)
    chunks = max(nbytes // _CHUNK, 1)
    buf = _aligned_buffer(_CHUNK)
    buf.write(os.urandom(_ALIGN) * (_CHUNK // _ALIGN))
    fd, name = tempfile.mkstemp(prefix=".kvtier-probe-", dir=directory)
    try:
        try:
            start = time.perf_counter()
            for i in range(chunks):
                os.pwrite(fd, buf, i * _CHUNK)
            os.fsync(fd)
            write_bps = chunks * _CHUNK / (time.perf_counter() - start)
        finally:
            os.close(fd)
        read_bps, latency = _read_back(name, chunks, buf)
    finally:
        os.unlink(name)
        buf.close()
    return {"disk-write-bw": write_bps, "disk-read-bw": read_bps, "disk-latency": latency}


def _read_back(name: str, chunks: int, buf: mmap.mmap) -> tuple[float, float]:
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(name, flags)
    except OSError:  # the filesystem refuses O_DIRECT (tmpfs): a warm read, said by the caller
        fd = os.open(name, os.O_RDONLY)
    try:
        view = memoryview(buf)
        start = time.perf_counter()
        for i in range(chunks):
            os.preadv(fd, [view], i * _CHUNK)
        read_bps = chunks * _CHUNK / (time.perf_counter() - start)
        small = view[:_ALIGN]
        samples = []
        for i in range(min(chunks, 16)):
            t0 = time.perf_counter()
            os.preadv(fd, [small], (chunks - 1 - i) * _CHUNK + _ALIGN)
            samples.append(time.perf_counter() - t0)
        view.release()
    finally:
        os.close(fd)
    samples.sort()
    return read_bps, samples[len(samples) // 2]


def probe_remote(url: str, nbytes: int, timeout_s: float) -> dict[str, float]:
    """Pipelined SET then GET of page-sized values on the configured Redis; keys removed."""
    import redis  # lazy: a server-side dependency

    client = redis.Redis.from_url(url, socket_timeout=max(timeout_s, 5.0))
    value = os.urandom(_CHUNK)
    keys = [f"kvtier:probe:{os.getpid()}:{i}" for i in range(max(nbytes // _CHUNK, 1))]
    try:
        start = time.perf_counter()
        client.ping()
        latency = time.perf_counter() - start
        write_bps = _best_rate(len(keys) * _CHUNK, lambda: _pipe_set(client, keys, value), 1)
        read_bps = _best_rate(len(keys) * _CHUNK, lambda: _pipe_get(client, keys), 1)
    finally:
        client.delete(*keys)
        client.close()
    return {"remote-write-bw": write_bps, "remote-read-bw": read_bps, "remote-latency": latency}


def _pipe_set(client: Any, keys: list[str], value: bytes) -> None:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.set(key, value)
    pipe.execute()


def _pipe_get(client: Any, keys: list[str]) -> None:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.get(key)
    pipe.execute()
