"""The copy-engine path: pages cross the bus as large copy-engine copies through device staging.

Owns ``StagedCopier``. The UVA kernels (``kernels.py``) reach ~92% of the bus in one direction,
but a load and a store at once share the SMs and the PCIe request slots: together they stay near
80 GB/s, and a kernel beside a copy-engine transfer slows both to under 60. The copy engines
reach the duplex peak (~94 GB/s on the H200) on large contiguous copies and use no SMs, which
also leaves the SMs to the forward pass that a layer-by-layer load overlaps.

In the ``page_first`` host layout each page, and each layer of a page (its K and V side by
side), is one contiguous host range. So a batch crosses the bus as one copy-engine copy per page
(whole-page copies) or per page and layer (one layer at a time), into or out of a dense staging
buffer in device memory, issued by one ``cuMemcpyBatchAsync`` call per chunk (whole pages with
consecutive host ids go as one copy: the allocator hands out runs); kvtier's kernel
does the scattered side device-to-device (HBM speed: a few percent of the bus time). A batch
larger than the staging buffer goes through in chunks; everything is enqueued on the caller's
current stream, so a chunk never overwrites staging that the previous chunk still reads.

The staging buffer is allocated once by the owner (``CopyEngine``) and never grows. Runs on the
thread that submits copies (the engine thread).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtier.transfer.ce_batch import BatchCopy
from kvtier.transfer.plan import CopyPlan, PoolGeometry

if TYPE_CHECKING:
    from kvtier.transfer.kernels import KernelConfig


class StagedCopier:
    """One direction's copies between a device pool and a ``page_first`` host pool through a
    staging buffer (a flat uint8 tensor on the device pool's device)."""

    def __init__(self, device_kv: torch.Tensor, host_buffer: torch.Tensor, host_geo: PoolGeometry,
                 staging: torch.Tensor, batch: BatchCopy, kernel_config: KernelConfig | None = None) -> None:
        if host_geo.layer_stride != host_geo.parts * host_geo.part_bytes \
                or host_geo.part_stride != host_geo.part_bytes:
            raise ValueError("the copy-engine path needs the page_first host layout")
        self.layer_bytes = host_geo.layer_stride
        self.page_bytes = host_geo.num_layers * self.layer_bytes
        if staging.numel() < self.page_bytes:
            raise ValueError(f"staging of {staging.numel()} bytes holds no page of "
                             f"{self.page_bytes} bytes")
        self._device_kv = device_kv
        self._host_base = int(host_buffer.data_ptr())
        self._host_geo = host_geo
        self._staging = staging
        self._batch = batch
        self._config = kernel_config

    def run(self, plan: CopyPlan) -> None:
        """Enqueue ``plan`` (a checked batch; ``load`` or ``store``) on the current stream."""
        if plan.num_pages == 0:
            return
        whole = plan.layer_start == 0 and plan.layer_count == self._host_geo.num_layers
        spans = [(0, plan.layer_count)] if whole else \
            [(layer, 1) for layer in range(plan.layer_start, plan.layer_start + plan.layer_count)]
        for first, count in spans:
            unit = count * self.layer_bytes
            per_chunk = max(1, self._staging.numel() // unit)
            for lo in range(0, plan.num_pages, per_chunk):
                hi = min(plan.num_pages, lo + per_chunk)
                self._chunk(plan, lo, hi, first, count, unit)

    def _chunk(self, plan: CopyPlan, lo: int, hi: int, first: int, count: int, unit: int) -> None:
        from kvtier.transfer.kernels import launch_copy

        n = hi - lo
        if n * unit > self._staging.numel():  # never a copy past the staging buffer
            raise ValueError(f"a chunk of {n * unit} bytes exceeds the staging buffer of "
                             f"{self._staging.numel()}")
        geo = self._host_geo
        whole = count == geo.num_layers
        staging_geo = PoolGeometry("staging", n, geo.part_bytes, geo.num_layers, geo.parts,
                                   page_stride=unit, layer_stride=self.layer_bytes if whole else 0,
                                   part_stride=geo.part_bytes)
        dense = np.arange(n, dtype=np.int64)
        staging = self._staging[:n * unit]
        staged = np.uint64(staging.data_ptr()) + dense.astype(np.uint64) * np.uint64(unit)
        host_ids = (plan.src_ids if plan.direction == "load" else plan.dst_ids)[lo:hi]
        hosted = (np.uint64(self._host_base) + host_ids.astype(np.uint64) * np.uint64(geo.page_stride)
                  + np.uint64(first * self.layer_bytes))
        sizes = np.full(n, unit, dtype=np.uint64)
        stream = _current_stream(self._device_kv)
        if plan.direction == "load":
            self._batch.copy(*merge_runs(staged, hosted, sizes), stream)
            scatter = CopyPlan("load", staging_geo, plan.dst, dense, plan.dst_ids[lo:hi],
                               first, count)
            launch_copy(scatter, self._device_kv, staging, self._config)
        else:
            gather = CopyPlan("store", plan.src, staging_geo, plan.src_ids[lo:hi], dense,
                              first, count)
            launch_copy(gather, self._device_kv, staging, self._config)
            self._batch.copy(*merge_runs(hosted, staged, sizes), stream)


def merge_runs(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Join copies that continue each other on both sides (consecutive host pages into
    consecutive staging slots) into one: fewer, larger copy-engine copies."""
    if sizes.size < 2:
        return dsts, srcs, sizes
    ends_dst, ends_src = dsts[:-1] + sizes[:-1], srcs[:-1] + sizes[:-1]
    breaks = (dsts[1:] != ends_dst) | (srcs[1:] != ends_src)
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    if starts.size == sizes.size:
        return dsts, srcs, sizes
    return dsts[starts], srcs[starts], np.add.reduceat(sizes, starts)


def _current_stream(tensor: torch.Tensor) -> int:
    if tensor.device.type != "cuda":
        return 0
    return int(torch.cuda.current_stream(tensor.device).cuda_stream)
