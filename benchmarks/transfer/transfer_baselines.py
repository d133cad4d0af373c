"""Raw ways to move scattered KV parts between pinned host memory and the device.

The baselines ``bench_transfer.py`` puts beside kvtier's kernels: timers (CUDA events and wall
clock), the pools and copy plans one benchmark size needs (``Setup``), the contiguous pinned peak,
one ``cudaMemcpyAsync`` per part, gather + one copy, and every part in one ``cuMemcpyBatchAsync``
(through ctypes, where the driver has it); plus the row format of the results. Needs CUDA.
Main thread.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvtier.layout import KVLayout
from kvtier.memory.device_pool import DevicePool
from kvtier.memory.host_pool import HostPool
from kvtier.memory.pinned import PinnedBudget
from kvtier.transfer.kernels import KernelConfig, launch_copy, upload_ids
from kvtier.transfer.plan import CopyPlan, device_geometry, host_geometry, make_plan

GIB = 1 << 30


def gpu_time(fn: Callable[[], None], reps: int, warmup: int = 2) -> float:
    """Median seconds of ``fn`` on the current stream, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def wall_time(fn: Callable[[], None], reps: int, warmup: int = 1) -> float:
    """Median wall seconds of ``fn`` from a synchronized start to a synchronized end."""
    for _ in range(warmup):
        fn()
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---- the copy engines through cuMemcpyBatchAsync (kvtier.transfer.ce_batch) ----------------------
def part_addresses(plan: CopyPlan, src_base: int, dst_base: int) -> tuple[np.ndarray, ...]:
    layers = np.arange(plan.layer_start, plan.layer_start + plan.layer_count, dtype=np.uint64)
    parts = np.arange(plan.src.parts, dtype=np.uint64)

    def offsets(geo: Any, ids: np.ndarray) -> np.ndarray:
        return (ids.astype(np.uint64)[:, None, None] * np.uint64(geo.page_stride)
                + layers[None, :, None] * np.uint64(geo.layer_stride)
                + parts[None, None, :] * np.uint64(geo.part_stride)).reshape(-1)

    srcs = offsets(plan.src, plan.src_ids) + np.uint64(src_base)
    dsts = offsets(plan.dst, plan.dst_ids) + np.uint64(dst_base)
    sizes = np.full(srcs.size, plan.src.part_bytes, dtype=np.uint64)
    return dsts, srcs, sizes


# ---- one part size -------------------------------------------------------------------------------
class Setup:
    """Pools of one part size and random scattered batches over them."""

    def __init__(self, part_kib: int, batch_bytes: int, host_layout: str, budget: PinnedBudget):
        self.layout = KVLayout(8, 8, 128, "bfloat16", part_kib * 1024 // 2048)
        self.n = max(1, batch_bytes // self.layout.page_bytes)
        pages = 2 * self.n
        self.host = HostPool(self.layout, pages, budget, host_layout, pin=True)
        self.dev = DevicePool(self.layout, pages, "cuda")
        self.host.buffer.fill_(7)
        self.dev.kv.view(torch.uint8).fill_(9)
        rng = np.random.default_rng(0)
        host_perm, dev_perm = rng.permutation(pages), rng.permutation(pages)
        dg, hg = device_geometry(self.layout, pages), host_geometry(self.layout, pages, host_layout)
        n = self.n
        self.load = make_plan("load", hg, dg, host_perm[:n], dev_perm[:n])
        self.store = make_plan("store", dg, hg, dev_perm[n:], host_perm[n:])

    def close(self) -> None:
        self.host.close()
        del self.dev

    def kernel(self, plan: CopyPlan, config: KernelConfig | None) -> Callable[[], None]:
        ids = upload_ids(plan, self.dev.kv.device)
        return lambda: launch_copy(plan, self.dev.kv, self.host.buffer, config, ids=ids)

    def per_layer(self, plan: CopyPlan, config: KernelConfig | None) -> Callable[[], None]:
        ids = upload_ids(plan, self.dev.kv.device)
        plans = [CopyPlan(plan.direction, plan.src, plan.dst, plan.src_ids, plan.dst_ids, layer, 1)
                 for layer in range(self.layout.num_layers)]
        return lambda: [launch_copy(p, self.dev.kv, self.host.buffer, config, ids=ids)
                        for p in plans]


def duplex_time(streams: tuple, load_fn: Callable, store_fn: Callable,
                reps: int) -> tuple[float, float, float]:
    """Median seconds of a load and a store started together: (both, load, store)."""
    runs = []
    for rep in range(reps + 1):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        ends = [torch.cuda.Event(enable_timing=True) for _ in streams]
        start.record()
        for stream, fn, end in zip(streams, (load_fn, store_fn), ends, strict=True):
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                fn()
                end.record(stream)
        torch.cuda.synchronize()
        if rep:  # the first run warms up
            times = [start.elapsed_time(end) / 1e3 for end in ends]
            runs.append((max(times), *times))
    return tuple(statistics.median(run[i] for run in runs) for i in range(3))


def measure_peak(nbytes: int, reps: int) -> dict[str, float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(2)
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = gpu_time(lambda: dev2.copy_(host, non_blocking=True), reps)
    d2h = gpu_time(lambda: host2.copy_(dev, non_blocking=True), reps)
    duplex, _, _ = duplex_time((torch.cuda.Stream(), torch.cuda.Stream()),
                               lambda: dev2.copy_(host, non_blocking=True),
                               lambda: host2.copy_(dev, non_blocking=True), reps)
    return {"h2d_gbs": nbytes / h2d / 1e9, "d2h_gbs": nbytes / d2h / 1e9,
            "duplex_gbs": 2 * nbytes / duplex / 1e9}


def per_part_memcpy(setup: Setup, plan: CopyPlan, max_copies: int) -> tuple[Callable, int]:
    """One cudaMemcpyAsync per part for the first pages of the batch (views built up front).

    The host side is a torch-pinned buffer of the same geometry: torch treats memory pinned with
    cudaHostRegister as pageable and would make every one of these copies synchronous.
    """
    lay, dev = setup.layout, setup.dev.bytes_view()
    pages = max(1, max_copies // (lay.num_layers * lay.parts))
    geo = plan.src if plan.direction == "load" else plan.dst
    mirror = torch.empty(setup.host.nbytes, dtype=torch.uint8, pin_memory=True)

    def host_part(page: int, layer: int, part: int) -> torch.Tensor:
        start = geo.part_offset(page, layer, part)
        return mirror[start:start + lay.part_bytes]

    pairs = []
    for s, d in zip(plan.src_ids[:pages].tolist(), plan.dst_ids[:pages].tolist(), strict=True):
        for layer in range(lay.num_layers):
            for part in range(lay.parts):
                if plan.direction == "load":
                    pairs.append((dev[layer, part, d], host_part(s, layer, part)))
                else:
                    pairs.append((host_part(d, layer, part), dev[layer, part, s]))

    def run() -> None:
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)

    return run, pages * lay.page_bytes


def gather_copy(setup: Setup, plan: CopyPlan, max_pages: int) -> tuple[Callable, int]:
    """Gather whole pages on the source side, one copy, scatter on the other side."""
    lay, dev = setup.layout, setup.dev.bytes_view()
    n = min(plan.num_pages, max_pages)
    src = torch.from_numpy(plan.src_ids[:n])
    dst = torch.from_numpy(plan.dst_ids[:n])
    host_pages = setup.host.buffer.view(-1, lay.page_bytes)
    staging = torch.empty(n, lay.page_bytes, dtype=torch.uint8, pin_memory=True)
    dev_staging = torch.empty(n, lay.num_layers, lay.parts, lay.part_bytes, dtype=torch.uint8,
                              device="cuda")
    src_d, dst_d = src.cuda(), dst.cuda()

    def load() -> None:
        torch.index_select(host_pages, 0, src, out=staging)
        dev_staging.view(n, -1).copy_(staging, non_blocking=True)
        dev[:, :, dst_d] = dev_staging.permute(1, 2, 0, 3)

    def store() -> None:
        dev_staging.copy_(dev[:, :, src_d].permute(2, 0, 1, 3))
        staging.copy_(dev_staging.view(n, -1), non_blocking=True)
        torch.cuda.current_stream().synchronize()
        host_pages.index_copy_(0, dst, staging)

    return (load if plan.direction == "load" else store), n * lay.page_bytes


def gbs(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def row(part_kib: int, direction: str, method: str, nbytes: int, seconds: float,
        peak_gbs: float) -> dict[str, Any]:
    rate = gbs(nbytes, seconds)
    return {"part_kib": part_kib, "direction": direction, "method": method,
            "mib": nbytes / 2**20, "gbs": rate, "pct_of_peak": 100.0 * rate / peak_gbs}
