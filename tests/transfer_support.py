"""Helpers shared by the transfer tests: pools filled with random bytes, and a part-by-part oracle.

The oracle walks every (page, layer, part) with the host pool's own addressing
(``HostPool.part``) and the device tensor's indexing (``kv[l, p, d]``), so it checks both the
kernels and the torch reference against code they share nothing with.
"""

from __future__ import annotations

import torch

from kvtier.layout import KVLayout
from kvtier.memory.device_pool import DevicePool
from kvtier.memory.host_pool import HostPool
from kvtier.memory.pinned import PinnedBudget

#: Host pools made for a CUDA device, closed by the GPU tests after each test: a pinned buffer
#: that is garbage-collected without ``close()`` stays registered with the driver.
OPEN_DEVICE_HOST_POOLS: list[HostPool] = []


def fill_random(tensor: torch.Tensor, seed: int) -> None:
    """Overwrite every byte of ``tensor`` with seeded random bytes (never zeros)."""
    flat = tensor.view(torch.uint8).view(-1)
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(1, 256, (flat.numel(),), dtype=torch.uint8, generator=gen)
    flat.copy_(values.to(flat.device))


def make_pools(layout: KVLayout, device_pages: int, host_pages: int, host_layout: str,
               device: str = "cpu", seed: int = 0) -> tuple[DevicePool, HostPool]:
    """A device pool and a host pool of ``layout``, both full of random bytes."""
    host = HostPool(layout, host_pages, PinnedBudget(1 << 36), host_layout, pin=device == "cuda")
    dev = DevicePool(layout, device_pages, device)
    if device == "cuda":
        OPEN_DEVICE_HOST_POOLS.append(host)
    fill_random(dev.kv, seed)
    fill_random(host.buffer, seed + 1)
    return dev, host


def part_by_part(direction: str, dev: DevicePool, host: HostPool, src_ids: list[int],
                 dst_ids: list[int], layers: range) -> None:
    """The slow oracle: copy one part at a time between two (CPU) pools."""
    dev_bytes = dev.kv.view(torch.uint8).view(*dev.kv.shape[:3], -1)
    for s, d in zip(src_ids, dst_ids, strict=True):
        for layer in layers:
            for part in range(host.layout.parts):
                if direction == "load":
                    dev_bytes[layer, part, d].copy_(host.part(s, layer, part))
                else:
                    host.part(d, layer, part).copy_(dev_bytes[layer, part, s])


def snapshot(dev: DevicePool, host: HostPool) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU byte copies of both pools."""
    return dev.kv.view(torch.uint8).cpu().clone(), host.buffer.clone()
