"""The torch reference of the page copies: the CPU fallback and the kernels' correctness oracle.

Owns ``reference_copy``: it moves the parts a ``CopyPlan`` names between the device pool tensor
and the host pool's flat byte buffer with plain tensor indexing over shaped byte views (it does
not use the plan's strides, so it checks the kernels' address arithmetic independently); with
both pools in host memory (a CPU device) it copies page by page, each page's slices at once. Runs on
the calling thread and is synchronous on the CPU; on CUDA tensors torch orders it on the current
stream.
"""

from __future__ import annotations

import torch

from kvtier.transfer.plan import CopyPlan


def device_part_view(device_kv: torch.Tensor) -> torch.Tensor:
    """The device pool as bytes, shaped ``[num_layers, parts, num_pages, part_bytes]``."""
    if not device_kv.is_contiguous():
        raise ValueError("the device pool tensor must be contiguous")
    layers, parts, pages = device_kv.shape[:3]
    return device_kv.view(torch.uint8).view(layers, parts, pages, -1)


def host_part_view(host_buffer: torch.Tensor, host_layout: str, num_layers: int, parts: int,
                   num_pages: int) -> torch.Tensor:
    """The host pool as bytes: ``[pages, layers, parts, part_bytes]`` (page_first) or
    ``[layers, pages, parts, part_bytes]`` (layer_first)."""
    if host_buffer.dtype != torch.uint8 or host_buffer.dim() != 1:
        raise ValueError("the host pool buffer must be a flat uint8 tensor")
    if host_layout == "page_first":
        return host_buffer.view(num_pages, num_layers, parts, -1)
    if host_layout == "layer_first":
        return host_buffer.view(num_layers, num_pages, parts, -1)
    raise ValueError(f"unknown host layout {host_layout!r}")


def reference_copy(plan: CopyPlan, device_kv: torch.Tensor, host_buffer: torch.Tensor,
                   host_layout: str) -> None:
    """Carry out ``plan`` with torch indexing (load: host -> device; store: device -> host)."""
    if plan.num_pages == 0:
        return
    device = device_part_view(device_kv)
    host_pages = plan.src.num_pages if plan.direction == "load" else plan.dst.num_pages
    host = host_part_view(host_buffer, host_layout, device.shape[0], device.shape[1],
                          host_pages)
    if _wordable(device) and _wordable(host):   # both sides in words, or both in bytes
        device, host = device.view(torch.int64), host.view(torch.int64)
    l0, l1 = plan.layer_start, plan.layer_start + plan.layer_count
    if device.device.type == "cpu":
        _copy_pages_on_cpu(plan, device, host, host_layout, l0, l1)
        return
    src_ids = torch.from_numpy(plan.src_ids)
    dst_ids = torch.from_numpy(plan.dst_ids)
    if plan.direction == "load":
        parts = _host_gather(host, host_layout, src_ids, l0, l1)  # [layers, parts, n, bytes]
        device[l0:l1, :, dst_ids.to(device.device)] = parts.to(device.device)
    else:
        parts = device[l0:l1, :, src_ids.to(device.device)].to(host.device)
        _host_scatter(host, host_layout, dst_ids, l0, l1, parts)


def _copy_pages_on_cpu(plan: CopyPlan, device: torch.Tensor, host: torch.Tensor,
                       host_layout: str, l0: int, l1: int) -> None:
    """Both pools in host memory: one slice copy per page, straight from source to
    destination. Indexing by a list of ids gathers into a temporary and scatters it element
    by element: on one thread that moved 0.4 GB/s, a copy of the page's slices moves several
    (``benchmarks/vllm/vllm_write_path.py``)."""
    load = plan.direction == "load"
    host_ids, device_ids = (plan.src_ids, plan.dst_ids) if load else (plan.dst_ids, plan.src_ids)
    for h, d in zip(host_ids.tolist(), device_ids.tolist(), strict=True):
        on_host = host[h, l0:l1] if host_layout == "page_first" else host[l0:l1, h]
        on_device = device[l0:l1, :, d]                 # [layers, parts, part]
        if load:
            on_device.copy_(on_host)
        else:
            on_host.copy_(on_device)


def _wordable(parts: torch.Tensor) -> bool:
    """Whether these bytes can be viewed as 8-byte elements (part size and address both
    multiples of 8): torch indexing moves one element at a time, and with one byte per element
    a CPU copy of 48 MiB took 3x as long."""
    return not (parts.shape[-1] % 8 or parts.storage_offset() % 8 or parts.data_ptr() % 8)


def _host_gather(host: torch.Tensor, host_layout: str, ids: torch.Tensor, l0: int,
                 l1: int) -> torch.Tensor:
    if host_layout == "page_first":
        return host[ids, l0:l1].permute(1, 2, 0, 3)
    return host[l0:l1, ids].permute(0, 2, 1, 3)


def _host_scatter(host: torch.Tensor, host_layout: str, ids: torch.Tensor, l0: int, l1: int,
                  parts: torch.Tensor) -> None:
    if host_layout == "page_first":
        host[ids, l0:l1] = parts.permute(2, 0, 1, 3)
    else:
        host[l0:l1, ids] = parts.permute(0, 2, 1, 3)
