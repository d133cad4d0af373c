"""Whole-block copies between a kvtier pool and vLLM's per-layer KV tensors, with kvtier's kernel.

Owns ``BlockCopier``, ``kernels_fit``, ``block_view`` and ``sub_pages``. One layer of one vLLM
block holds ``block_size * kv_heads`` K rows and as many V rows of ``head_dim`` contiguous
elements each, wherever vLLM's stride order puts them (``layout.BlockLayout.rows``); one layer
of a kvtier page holds the same rows in canonical order (``[K|V, page_size, heads, head_dim]``).
``transfer.rows``' kernel moves them row tile by row tile between the two geometries, one launch
per layer (a load, layer by layer as its copy from host lands) or per request (a save, every
layer at once: ``copy_layers``), with no per-token indexing and no staging copy. A kvtier page of k
blocks is k block-sized sub-pages, consecutive in the page (``block_view``: the pool seen as a
pool of block-sized pages, sub-page ``page * k + j`` holding tokens ``[j * block, (j + 1) *
block)`` of ``page``), so large kvtier pages still move into small vLLM blocks whole.

``copy`` runs one layer of a checked plan on the caller's current stream (on CUDA: ordered
after the attention that wrote the blocks, before the one that reads them). Without the kernel
(vLLM's CPU backend and its transposed K, a page size that is not a multiple of the block size,
a head dimension that is not contiguous, another dtype or device) the caller keeps to
``layout``'s torch gathers. Runs on vLLM's model-runner thread (loads, saves in the step, the
warm-up at registration) or kvtier's saver thread (CPU saves, finished requests' pages).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.integrations.vllm.layout import BlockLayout
from kvtier.transfer.rows import (
    BoundRowCopy,
    RowCopy,
    RowGeometry,
    RowPlan,
    make_row_plan,
    upload_pairs,
)

#: Programs per multiprocessor of the copies between kvtier's device pool and vLLM's blocks. A
#: load's copies run on the forward's stream, each just before the layer that reads it, while the
#: host -> pool copy of the later layers is still in flight on kvtier's load stream: a grid that
#: fills every SM delays that copy's next launch, and the bus, not the device-to-device copy,
#: sets the pace. On the H200, with the load in flight, 1 per SM was ahead of 4 per SM in 7 of 8
#: cells of layout x block size x prefix in the run this was chosen on, and 4 per SM had won
#: only while the copies ran after the whole load had landed, with nothing beside them
#: (benchmarks/results/vllm_copy_h200.*).
DEVICE_PROGRAMS_PER_SM = 1


def pool_rows(pool_kv: torch.Tensor) -> RowGeometry:
    """One layer of a kvtier pool ``[layers, 2, pages, page_size, heads, dim]`` as blocks of
    rows whose blocks are its pages (or sub-pages, through ``block_view``), strides read from
    the tensor: the device pool (contiguous) or the host pool's pages (``direct.host_kv``)."""
    _, _, pages, page_size, heads, dim = pool_kv.shape
    _, part, page, token, head, unit = pool_kv.stride()
    if unit != 1:
        raise ValueError(f"a pool whose head dimension has stride {unit}, not 1")
    return RowGeometry(pages, page_size, heads, dim, block_stride=page, part_stride=part,
                       token_stride=token, head_stride=head)


def kernels_fit(layout: BlockLayout, kv: torch.Tensor, pool_kv: torch.Tensor,
                page_size: int) -> bool:
    """Whether ``kv`` (one layer's tensor) and kvtier's pool can be copied by the kernel."""
    return (layout.rows() is not None and page_size % layout.block_size == 0
            and kv.dtype == pool_kv.dtype and kv.device == pool_kv.device)


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


@dataclass(frozen=True)
class BlockPlan:
    """A checked copy of whole blocks (every layer): ``load`` pool sub-pages -> vLLM blocks,
    ``store`` vLLM blocks -> pool sub-pages."""

    direction: str
    rows: RowPlan

    @property
    def num_pages(self) -> int:
        return self.rows.num_blocks


class BlockCopier:
    """Copies whole blocks of one layer between kvtier's pool (``block_view``: sub-pages of the
    block size) and vLLM's tensor of that layer."""

    def __init__(self, layout: BlockLayout, pool_kv: torch.Tensor,
                 programs_per_sm: int = DEVICE_PROGRAMS_PER_SM,
                 device: torch.device | None = None, store_programs: int | None = None) -> None:
        """``device``: where the copies run, when the pool is not there (host pages read and
        written through unified addressing: the direct path). ``store_programs``: a grid cap
        of the stores (vLLM blocks -> pool) in place of ``programs_per_sm``."""
        vllm_rows = layout.rows()
        if vllm_rows is None:
            raise ValueError(f"{layout.name or layout.kind} blocks cannot be copied by rows")
        self.layout = layout
        self.pool_kv = pool_kv
        self.pool = pool_kv
        self.device = pool_kv.device if device is None else device   # where the copies run
        self.pool_rows = pool_rows(pool_kv)
        self.vllm_rows = vllm_rows
        self._load = RowCopy(self.pool_rows, vllm_rows, programs_per_sm=programs_per_sm)
        self._store = RowCopy(vllm_rows, self.pool_rows, max_programs=store_programs,
                              programs_per_sm=programs_per_sm)
        #: Launch arguments per (direction, first layer, vLLM tensors), worked out at first use.
        self._bound: dict[tuple[str, int, tuple[int, ...]], BoundRowCopy] = {}

    @classmethod
    def for_device_pool(cls, layout: BlockLayout, pool_kv: torch.Tensor,
                        programs_per_sm: int = DEVICE_PROGRAMS_PER_SM) -> BlockCopier:
        """Over kvtier's device pool seen through ``block_view`` (``pool_kv``)."""
        return cls(layout, pool_kv, programs_per_sm)

    def plan(self, direction: str, sources: np.ndarray, destinations: np.ndarray) -> BlockPlan:
        """A checked copy of every layer, made once per request and launched layer by layer."""
        if direction == "load":
            return BlockPlan("load", make_row_plan(self.pool_rows, self.vllm_rows, sources,
                                                   destinations))
        return BlockPlan("store", make_row_plan(self.vllm_rows, self.pool_rows, sources,
                                                destinations))

    @staticmethod
    def ids(plan: BlockPlan, device: torch.device) -> torch.Tensor:
        """``plan``'s ``[2, n]`` id pairs on ``device``, uploaded once for every layer."""
        return upload_pairs(plan.rows, device)

    def copy(self, plan: BlockPlan, layer: int, kv: torch.Tensor,
             ids: torch.Tensor | None = None) -> None:
        """Launch layer ``layer`` of ``plan`` with ``kv`` as that layer's vLLM tensor, on the
        current stream (``ids``: ``ids(plan)`` uploaded before, else uploaded now)."""
        self._bind(plan.direction, layer, [kv]).launch(plan.rows, ids)

    def copy_layers(self, plan: BlockPlan, kvs: Sequence[torch.Tensor],
                    ids: torch.Tensor | None = None) -> None:
        """Launch every layer of ``plan`` at once, ``kvs[l]`` being layer ``l``'s vLLM tensor:
        one launch in place of one per layer (a save's copy, queued after the whole forward)."""
        self._bind(plan.direction, 0, kvs).launch(plan.rows, ids)

    def _bind(self, direction: str, first: int, kvs: Sequence[torch.Tensor]) -> BoundRowCopy:
        key = (direction, first, tuple(kv.data_ptr() for kv in kvs))
        bound = self._bound.get(key)
        if bound is None:
            pools = [self.pool_kv[first + i] for i in range(len(kvs))]
            bound = self._load.bind(pools, kvs) if direction == "load" \
                else self._store.bind(kvs, pools)
            self._bound[key] = bound
        return bound

    def load(self, layer: int, pages: np.ndarray, blocks: np.ndarray, kv: torch.Tensor) -> None:
        """Copy layer ``layer`` of kvtier sub-pages ``pages`` into vLLM ``blocks`` of ``kv``."""
        self.copy(self.plan("load", pages, blocks), layer, kv)

    def save(self, layer: int, blocks: np.ndarray, pages: np.ndarray, kv: torch.Tensor) -> None:
        """Copy vLLM ``blocks`` of ``kv`` into layer ``layer`` of kvtier sub-pages ``pages``."""
        self.copy(self.plan("store", blocks, pages), layer, kv)
