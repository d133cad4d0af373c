"""The connector's direct path: KV moves between vLLM's blocks and kvtier's host pages, with no
staging pages of kvtier's on the GPU (connector key ``"direct": true``).

Owns ``host_kv`` (the host pool's bytes seen as a ``[layers, K|V, pages, page_size, heads,
head_dim]`` tensor, no copy), ``EventTicket`` (a copy queued on a CUDA stream, as the cache's
tickets go) and ``DirectCopies``, the tensor work of the path:

- a load copies the host pages a hit holds (``TieredCache.hold_host``: verified, pinned; the
  part only a store held landed there first) into vLLM's blocks, layer by layer as the
  forward reaches each layer (or every layer before a full CUDA graph's replay), on the
  forward's stream; the pages stay pinned until that step's copies are over (``EventTicket``);
- a save writes the prompt's pages the host tier lacks straight from vLLM's blocks into host
  pages (``TieredCache.save_host``), every layer in one launch on the forward's stream once
  the forward is queued; they enter kvtier's index when that launch is over, and go on to the
  stores from there as any host page does.

On CUDA the copies are kvtier's row kernel (``transfer.rows``) reading or writing pinned host
memory through unified addressing, where vLLM's layout has contiguous head rows and the kvtier
page is one vLLM block (``page_size`` = block size, the default); otherwise torch gathers by
row (vLLM's CPU backend, where host pages are plain memory; on CUDA they go through the host
and wait, and the start-up log says so). Compared with the staged path, every load and save
crosses the bus once with nothing in between, and vLLM keeps the GPU memory the staging pages
would take; kvtier's device tier is not used. One worker in the engine-core process only
(refused with tensor parallelism at start). Runs on vLLM's model-runner thread.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from kvtier.integrations.vllm.blocks import BlockCopier, BlockPlan
from kvtier.integrations.vllm.layout import BlockLayout
from kvtier.integrations.vllm.specs import LoadSpec, SaveSpec
from kvtier.memory.device_pool import torch_dtype

log = logging.getLogger(__name__)


def host_kv(host_pool: Any) -> torch.Tensor:
    """The host pool as ``[layers, parts, pages, page_size, heads, head_dim]`` over its bytes
    (either host layout; a strided view, nothing copied)."""
    layout = host_pool.layout
    flat = host_pool.buffer.view(torch_dtype(layout.dtype))
    layers, parts, page, heads, dim = layout.page_shape()
    part = page * heads * dim
    if host_pool.host_layout == "page_first":
        strides = (parts * part, part, layers * parts * part)
    else:                                       # layer_first
        strides = (host_pool.num_pages * parts * part, part, parts * part)
    return torch.as_strided(flat, (layers, parts, host_pool.num_pages, page, heads, dim),
                            (*strides, heads * dim, dim, 1))


class DoneTicket:
    """A copy that was over when it returned (the CPU's)."""

    def is_done(self) -> bool:
        return True

    def wait(self, timeout_s: float | None = None) -> bool:
        return True


class EventTicket:
    """Copies queued on the current CUDA stream of ``device`` up to now."""

    def __init__(self, device: torch.device) -> None:
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(device))

    def is_done(self) -> bool:
        return bool(self.event.query())

    def wait(self, timeout_s: float | None = None) -> bool:
        if timeout_s is None:
            self.event.synchronize()
            return True
        deadline = time.monotonic() + timeout_s
        while not self.event.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0005)
        return True


def kernels_fit_host(layout: BlockLayout, kv: torch.Tensor, pool: torch.Tensor,
                     page_size: int) -> bool:
    """Whether the row kernel moves whole blocks between ``kv`` and host pages ``pool``: head
    rows contiguous in vLLM's layout, one block per kvtier page, the same dtype."""
    return (layout.rows() is not None and page_size == layout.block_size
            and kv.dtype == pool.dtype)


class DirectCopies:
    """Loads and saves of the direct path over vLLM's registered tensors (one per layer)."""

    def __init__(self, runtime: Any, kv_caches: list[torch.Tensor], layout: BlockLayout,
                 use_kernels: bool | None = None) -> None:
        self.runtime = runtime
        self.kv_caches = kv_caches
        self.layout = layout
        self.pool = host_kv(runtime.cache.host_pool)
        self.device = kv_caches[0].device
        wanted = self.device.type == "cuda" if use_kernels is None else use_kernels
        fits = all(kernels_fit_host(layout, kv, self.pool, runtime.page_size) for kv in kv_caches)
        self.blocks = (BlockCopier(layout, self.pool, device=self.device)
                       if wanted and fits else None)

    @property
    def by(self) -> str:
        return "the row kernel over pinned host memory" if self.blocks is not None \
            else "torch gathers"

    def warm_up(self) -> None:
        """Compile the kernel both ways before the first request: block 0 of the first layer
        into a host page-shaped scratch buffer of the same geometry and back."""
        if self.blocks is None:
            return
        scratch = torch.empty_like(self.pool[:, :, :1].contiguous().view(-1),
                                   pin_memory=self.device.type == "cuda")
        pool = self.pool
        view = torch.as_strided(scratch, (*pool.shape[:2], 1, *pool.shape[3:]), pool.stride())
        copier = BlockCopier(self.layout, view, device=self.device)
        kv = self.kv_caches[0]
        copier.save(0, np.array([0]), np.array([0]), kv)
        copier.load(0, np.array([0]), np.array([0]), kv)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def ticket(self) -> DoneTicket | EventTicket:
        """A ticket of every copy queued so far on this thread's stream."""
        return EventTicket(self.device) if self.device.type == "cuda" else DoneTicket()

    # ---- loads -------------------------------------------------------------------------------
    def plan_load(self, spec: LoadSpec, held: Any) -> tuple[torch.Tensor, torch.Tensor,
                                                           BlockPlan | None, Any]:
        """Rows of ``spec``'s tokens to copy by row (host rows ``page * page_size + offset``,
        vLLM slots) and the kernel's plan and ids for the blocks it moves whole."""
        page, block = self.runtime.page_size, self.layout.block_size
        tokens = torch.arange(spec.start, spec.end)
        pages = torch.tensor(held.host_page_ids, dtype=torch.long)
        rows = pages[tokens // page] * page + tokens % page
        table = torch.tensor(spec.block_ids, dtype=torch.long)
        slots = table[tokens // block] * block + tokens % block
        if self.blocks is None:
            return rows, slots, None, None
        first, stop = -(-spec.start // block), spec.end // block      # whole blocks
        whole = (tokens >= first * block) & (tokens < stop * block)
        plan = ids = None
        if stop > first:
            plan = self.blocks.plan("load", pages[first:stop].numpy(),
                                    np.asarray(spec.block_ids[first:stop]))
            ids = self.blocks.ids(plan, self.device)
        return rows[~whole], slots[~whole], plan, ids

    def load_layer(self, layer: int, kv: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                   plan: BlockPlan | None, ids: Any) -> None:
        """Copy one layer of a planned load into ``kv`` on the current stream."""
        if plan is not None:
            assert self.blocks is not None
            self.blocks.copy(plan, layer, kv, ids)
        if len(rows):
            page = self.runtime.page_size
            at = (rows // page, rows % page)
            keys, values = self.pool[layer, 0][at], self.pool[layer, 1][at]
            self.layout.write(kv, slots.to(kv.device), keys.to(kv.device),
                              values.to(kv.device))

    # ---- saves -------------------------------------------------------------------------------
    def save(self, spec: SaveSpec) -> int:
        """Store ``spec``'s full pages the host tier lacks from vLLM's blocks straight into host
        pages; returns the tokens written (0: held already, or no room on host)."""
        rt = self.runtime
        written = [0]

        def fill(first: int, host_ids: list[int]) -> DoneTicket | EventTicket:
            self._copy_out(spec, first, host_ids)
            written[0] = len(host_ids) * rt.page_size
            return self.ticket()

        with rt.lock:
            pages = rt.cache.save_host(list(spec.tokens), fill, spec.salt)
            if not pages:
                rt.counts["saves_refused_no_host_room"] += 1
            elif not written[0]:
                rt.counts["saves_skipped_held"] += 1
            rt.counts["saved_tokens"] += written[0]
        return written[0]

    def _copy_out(self, spec: SaveSpec, first: int, host_ids: list[int]) -> None:
        """Pages ``[first, first + len(host_ids))`` of ``spec`` into ``host_ids``, every layer."""
        page, block = self.runtime.page_size, self.layout.block_size
        if self.blocks is not None:           # one block per page
            blocks = np.asarray(spec.block_ids[first:first + len(host_ids)])
            plan = self.blocks.plan("store", blocks, np.asarray(host_ids))
            self.blocks.copy_layers(plan, self.kv_caches, self.blocks.ids(plan, self.device))
            return
        tokens = torch.arange(first * page, (first + len(host_ids)) * page)
        table = torch.tensor(spec.block_ids, dtype=torch.long)
        slots = (table[tokens // block] * block + tokens % block).to(self.device)
        at = (torch.tensor(host_ids, dtype=torch.long)[tokens // page - first], tokens % page)
        for layer, kv in enumerate(self.kv_caches):
            keys, values = self.layout.read(kv, slots)
            self.pool[layer, 0][at] = keys.to("cpu", self.pool.dtype)
            self.pool[layer, 1][at] = values.to("cpu", self.pool.dtype)
