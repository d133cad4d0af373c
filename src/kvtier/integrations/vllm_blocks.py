"""Whole-block copies between a kvtier pool and vLLM's per-layer KV tensors, with kvtier's kernels.

Owns ``BlockCopier``, ``layer_geometry`` and ``block_view``. When kvtier's page size equals
vLLM's block size, one layer of one vLLM block in flash-attention's ``[2, blocks, block, heads,
dim]`` or FlashInfer's ``[blocks, 2, block, heads, dim]`` tensor is two contiguous parts, K then
V, each ``[block, heads, dim]``: exactly one layer of a kvtier page in its canonical order (a
page is ``[layers, K|V, page_size, heads, head_dim]``). So a block moves as a page does between
kvtier's tiers. A page of k blocks is k such sub-pages, consecutive in the page (``block_view``:
the pool seen as a pool of block-sized pages, sub-page ``page * k + j`` holding tokens ``[j *
block, (j + 1) * block)`` of ``page``), so large kvtier pages (fewer, larger copies on the bus,
e.g. through the copy engines) still move into small vLLM blocks whole. ``layer_geometry``
describes the vLLM tensor as a ``transfer.plan.PoolGeometry`` (its layer stride 0: every layer
is a tensor of its own, copied one launch per layer) and the copy is
``transfer.kernels.PreparedCopy``, the Triton kernel kvtier's copy engine moves pages with, one
launch per layer and request, with no per-token indexing and no staging copy. The kernel sees
two pointers and two sets of strides; the kvtier side may be its device pool or its pinned host
pool (the kernel reads pinned memory in place).

``load`` moves pages of a kvtier pool into vLLM blocks, ``save`` blocks into pages, both for one
layer on the caller's current stream (on CUDA: ordered after the attention that wrote them,
before the one that reads them). Without kernels (vLLM's CPU backend, its ``[blocks, heads,
block, 2*dim]`` layout, a page size that is not a multiple of the block size, a strided tensor)
the caller keeps to ``vllm_layout``'s torch gathers. Runs on vLLM's model-runner thread (loads,
forward saves) or kvtier's saver thread (CPU saves).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvtier.integrations.vllm_layout import BlockLayout
from kvtier.transfer.plan import CopyPlan, PoolGeometry, device_geometry, make_plan

#: Layouts whose blocks are a canonical page layer (K part, then V part, each contiguous).
KERNEL_KINDS = ("flash", "flashinfer")
#: Programs per multiprocessor of the copies between kvtier's device pool and vLLM's blocks. A
#: load's copies run on the forward's stream, each just before the layer that reads it, while the
#: host -> pool copy of the later layers is still in flight on kvtier's load stream: a grid that
#: fills every SM delays that copy's next launch, and the bus, not the device-to-device copy,
#: sets the pace. On the H200, with the load in flight, 1 per SM was ahead of 4 per SM in 7 of 8
#: cells of layout x block size x prefix in the run this was chosen on (e.g. 0.90 against 0.89 of
#: the pinned rate at 4k tokens in 16-token flash blocks) and in 6 of 8 in the latest
#: (benchmarks/results/vllm_copy_h200.*, which keeps the rows of 2 and 4 per SM). 4 per SM had
#: won while the copies ran only after the whole load had landed, with nothing beside them.
DEVICE_PROGRAMS_PER_SM = 1


def layer_geometry(layout: BlockLayout, element_size: int, num_layers: int) -> PoolGeometry:
    """One vLLM layer tensor as a pool whose pages are its blocks (any layer: stride 0)."""
    if layout.kind not in KERNEL_KINDS:
        raise ValueError(f"{layout.kind} blocks are not canonical page layers")
    part = layout.block_size * layout.kv_heads * layout.head_dim * element_size
    n = layout.num_blocks
    if layout.kind == "flash":      # [2, blocks, ...]: K of every block, then V of every block
        page_stride, part_stride = part, n * part
    else:                           # [blocks, 2, ...]: K and V of one block side by side
        page_stride, part_stride = 2 * part, part
    return PoolGeometry(f"vLLM {layout.kind} layer", n, part, num_layers, 2,
                        page_stride=page_stride, layer_stride=0, part_stride=part_stride)


def kernels_fit(layout: BlockLayout, kv: torch.Tensor, pool_kv: torch.Tensor,
                page_size: int) -> bool:
    """Whether ``kv`` (one layer's tensor) and kvtier's pool can be copied by the kernels."""
    return (layout.kind in KERNEL_KINDS and page_size % layout.block_size == 0
            and kv.is_contiguous() and kv.dtype == pool_kv.dtype
            and kv.device == pool_kv.device)


def block_view(pool_kv: torch.Tensor, block_size: int) -> torch.Tensor:
    """kvtier's pool ``[layers, 2, pages, page_size, heads, dim]`` as a pool of block-sized
    sub-pages ``[layers, 2, pages * k, block_size, heads, dim]`` (``k = page_size //
    block_size``; the same bytes)."""
    layers, parts, pages, page_size, heads, dim = pool_kv.shape
    if page_size % block_size:
        raise ValueError(f"page size {page_size} is not a multiple of block size {block_size}")
    k = page_size // block_size
    return pool_kv.view(layers, parts, pages * k, block_size, heads, dim)


def sub_pages(pages: torch.Tensor, page_size: int, block_size: int) -> torch.Tensor:
    """The sub-page ids (``block_view``) of every block of ``pages``, in prefix order."""
    k = page_size // block_size
    return (pages.reshape(-1, 1) * k + torch.arange(k)).reshape(-1)


class BlockCopier:
    """Copies whole blocks of one layer between a kvtier pool and vLLM's tensor of that layer.

    ``pool`` is the kvtier side as a flat byte tensor (the device pool's ``kv`` flattened, or
    the pinned host pool's buffer), ``pool_geometry`` its strides; ``layout`` the vLLM side.
    """

    def __init__(self, layout: BlockLayout, pool: torch.Tensor, pool_geometry: PoolGeometry,
                 element_size: int, kernel_config: Any = None) -> None:
        self.layout = layout
        self.pool = pool.reshape(-1).view(torch.uint8)
        self.pool_geometry = pool_geometry
        self.vllm_geometry = layer_geometry(layout, element_size, pool_geometry.num_layers)
        self.kernel_config = kernel_config

    @classmethod
    def for_device_pool(cls, layout: BlockLayout, pool_kv: torch.Tensor,
                        kernel_config: Any = None) -> BlockCopier:
        """Over kvtier's device pool ``kv[layers, 2, pages, page_size, heads, dim]``, on a grid
        of ``DEVICE_PROGRAMS_PER_SM`` unless ``kernel_config`` says otherwise."""
        from kvtier.layout import KVLayout
        from kvtier.transfer.kernels import KernelConfig

        if kernel_config is None:
            kernel_config = KernelConfig(programs_per_sm=DEVICE_PROGRAMS_PER_SM)

        layers, _, pages, page_size, heads, dim = pool_kv.shape
        dtype = str(pool_kv.dtype).removeprefix("torch.")
        geometry = device_geometry(KVLayout(layers, heads, dim, dtype, page_size), pages)
        return cls(layout, pool_kv, geometry, pool_kv.element_size(), kernel_config)

    def plan(self, direction: str, sources: np.ndarray, destinations: np.ndarray) -> CopyPlan:
        """A checked copy of every layer (``load``: pool pages -> blocks; ``store``: blocks ->
        pool pages), made once per request and launched layer by layer."""
        if direction == "load":
            return make_plan("load", self.pool_geometry, self.vllm_geometry, sources,
                             destinations)
        return make_plan("store", self.vllm_geometry, self.pool_geometry, sources, destinations)

    @staticmethod
    def ids(plan: CopyPlan, device: torch.device) -> torch.Tensor:
        """``plan``'s ``[2, n]`` id pairs on ``device``, uploaded once for every layer (from
        pageable memory, as the copy engine's ids are)."""
        from kvtier.transfer.kernels import upload_ids

        return upload_ids(plan, device)

    def copy(self, plan: CopyPlan, layer: int, kv: torch.Tensor,
             ids: torch.Tensor | None = None) -> None:
        """Launch layer ``layer`` of ``plan`` with ``kv`` as that layer's vLLM tensor, on the
        current stream (``ids``: ``ids(plan)`` uploaded before, else uploaded now)."""
        from kvtier.transfer.kernels import PreparedCopy

        if plan.num_pages:
            PreparedCopy(plan, kv, self.pool, self.kernel_config, ids).launch(layer, 1)

    def load(self, layer: int, pages: np.ndarray, blocks: np.ndarray, kv: torch.Tensor,
             ids: torch.Tensor | None = None) -> None:
        """Copy layer ``layer`` of kvtier ``pages`` into vLLM ``blocks`` of ``kv``."""
        self.copy(self.plan("load", pages, blocks), layer, kv, ids)

    def save(self, layer: int, blocks: np.ndarray, pages: np.ndarray, kv: torch.Tensor,
             ids: torch.Tensor | None = None) -> None:
        """Copy vLLM ``blocks`` of ``kv`` into layer ``layer`` of kvtier ``pages``."""
        self.copy(self.plan("store", blocks, pages), layer, kv, ids)
