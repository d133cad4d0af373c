"""The device tier's page pool: the KV of every device page in one tensor, plus its allocator.

Owns ``DevicePool``: ``kv`` of shape ``[num_layers, parts, num_pages, page_size, kv_heads,
head_dim]`` in the KV dtype (docs/architecture.md, "Device pool"), so ``kv[l]`` is one layer of
every page (what an attention layer reads, and what a per-layer load fills) and ``kv[l, p, d]``
is one contiguous part of device page ``d``; and a ``PageAllocator`` over the page ids. Sizing
from free device memory (``cache.device_pages`` 0) is ``pages_for_memory``.

Bookkeeping (allocate/free ids) runs on the engine thread; the transfer layer and the model read
and write the bytes of ids they were handed, ordered by CUDA streams and events.
"""

from __future__ import annotations

import os

import torch

from kvtier.config import CacheConfig
from kvtier.errors import ConfigError, LayoutMismatch
from kvtier.layout import KVLayout
from kvtier.memory.allocator import PageAllocator


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``KVLayout.dtype`` name (e.g. 'bfloat16', 'float8_e4m3fn')."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError("layout.dtype", name, "a torch dtype name")
    return dtype


def pages_for_memory(layout: KVLayout, free_bytes: int, fraction: float) -> int:
    """Whole pages that fit in ``fraction`` of ``free_bytes``."""
    if not 0.0 < fraction <= 1.0:
        raise ConfigError("cache.device_memory_fraction", fraction, "a share in (0, 1]")
    return int(free_bytes * fraction) // layout.page_bytes


#: Largest CPU "device" pool sized from free memory (a CPU pool only stands in for a GPU).
CPU_DEVICE_POOL_CAP_BYTES = 1 << 30


def cpu_pool_pages(config: CacheConfig, layout: KVLayout) -> int:
    """Pages of a CPU pool: ``cache.device_pages``, else ``cache.device_memory_fraction`` of
    the available memory, at most ``CPU_DEVICE_POOL_CAP_BYTES``."""
    if config.device_pages:
        return int(config.device_pages)
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    budget = min(int(available * config.device_memory_fraction), CPU_DEVICE_POOL_CAP_BYTES)
    return max(1, budget // layout.page_bytes)


class DevicePool:
    """Pages of KV on one device; see the module docstring for the tensor layout."""

    def __init__(self, layout: KVLayout, num_pages: int, device: str | torch.device = "cpu",
                 name: str = "device_pool") -> None:
        if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 1:
            raise ConfigError("cache.device_pages", num_pages, "an integer >= 1")
        self.layout = layout
        self.num_pages = num_pages
        self.device = torch.device(device)
        shape = (layout.num_layers, layout.parts, num_pages, *layout.part_shape())
        self.kv = torch.empty(shape, dtype=torch_dtype(layout.dtype), device=self.device)
        self.kv.view(torch.uint8).zero_()
        self.allocator = PageAllocator(num_pages, name=name)

    @classmethod
    def over(cls, layout: KVLayout, kv: torch.Tensor, name: str = "device_pool") -> DevicePool:
        """A pool whose pages are the bytes of ``kv``, a tensor someone else allocated (a
        shared-memory mapping), shaped and typed as the pool of ``layout`` would be."""
        expected = (layout.num_layers, layout.parts, kv.shape[2] if kv.dim() > 2 else 0,
                    *layout.part_shape())
        if tuple(kv.shape) != expected or kv.dtype != torch_dtype(layout.dtype) \
                or not kv.is_contiguous():
            raise LayoutMismatch(f"a pool tensor {list(kv.shape)} {kv.dtype} for layout "
                                 f"{list(expected)} {layout.dtype} (contiguous)")
        pool = cls.__new__(cls)
        pool.layout, pool.num_pages, pool.device = layout, int(kv.shape[2]), kv.device
        pool.kv = kv
        pool.allocator = PageAllocator(pool.num_pages, name=name)
        if pool.num_pages < 1:
            raise ConfigError("cache.device_pages", pool.num_pages, "an integer >= 1")
        return pool

    def release(self) -> None:
        """Give the pages' device memory back once nothing reads or writes them any more (the
        pool's owner closed): ``kv`` becomes an empty tensor of the same layout, so a holder
        that kept the pool does not keep its memory."""
        empty = (*self.kv.shape[:2], 0, *self.kv.shape[3:])
        self.kv = torch.empty(empty, dtype=self.kv.dtype, device=self.device)

    @classmethod
    def from_free_memory(cls, layout: KVLayout, fraction: float,
                         device: str | torch.device = "cuda") -> DevicePool:
        """A pool sized to ``fraction`` of the device's free memory (``cache.device_pages`` 0)."""
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ConfigError("cache.device_pages", 0, "an explicit page count off CUDA")
        free, _total = torch.cuda.mem_get_info(dev)
        pages = pages_for_memory(layout, free, fraction)
        if pages < 1:
            raise ConfigError("cache.device_memory_fraction", fraction,
                              f"a share of {free} free bytes holding at least one "
                              f"{layout.page_bytes}-byte page")
        return cls(layout, pages, dev)

    @classmethod
    def from_config(cls, config: CacheConfig, layout: KVLayout, device: str) -> DevicePool:
        """The pool ``cache.device_pages`` asks for; 0 sizes it from free memory
        (``cache.device_memory_fraction``; on the CPU at most ``CPU_DEVICE_POOL_CAP_BYTES``)."""
        if config.device_pages:
            return cls(layout, config.device_pages, device)
        if str(device).startswith("cuda"):
            return cls.from_free_memory(layout, config.device_memory_fraction, device)
        return cls(layout, cpu_pool_pages(config, layout), device)

    # ---- views -------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def layer(self, layer: int) -> torch.Tensor:
        """``[parts, num_pages, page_size, kv_heads, head_dim]``: one layer of every page."""
        return self.kv[layer]

    def keys(self, layer: int) -> torch.Tensor:
        """K of one layer, ``[num_pages, page_size, kv_heads, head_dim]`` (the latent for MLA)."""
        return self.kv[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        """V of one layer (MLA layouts have none)."""
        if self.layout.mla:
            raise LayoutMismatch("an MLA layout keeps one latent per layer and no separate V")
        return self.kv[layer, 1]

    def page(self, page: int) -> torch.Tensor:
        """A (strided) view of one page in canonical shape ``[layers, parts, page_size, ...]``."""
        if not 0 <= page < self.num_pages:
            raise IndexError(f"device page {page} outside [0, {self.num_pages})")
        return self.kv[:, :, page]

    def bytes_view(self) -> torch.Tensor:
        """The pool as bytes, ``[num_layers, parts, num_pages, part_bytes]``."""
        lay = self.layout
        return self.kv.view(torch.uint8).view(lay.num_layers, lay.parts, self.num_pages,
                                              lay.part_bytes)

    def stats(self) -> dict[str, object]:
        alloc = self.allocator.stats()
        return {"num_pages": self.num_pages, "page_bytes": self.layout.page_bytes,
                "bytes": self.nbytes, "device": str(self.device), "free": alloc["free"],
                "used": alloc["used"], "allocated_total": alloc["allocated_total"],
                "refused_total": alloc["refused_total"]}
