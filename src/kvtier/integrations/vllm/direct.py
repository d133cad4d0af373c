"""The connector's direct path: KV moves between vLLM's blocks and kvtier's host pages, with no
staging pages of kvtier's on the GPU (connector key ``"direct": true``).

Owns ``host_kv`` (the host pool's bytes seen as a ``[layers, K|V, pages, page_size, heads,
head_dim]`` tensor, no copy), ``EventTicket`` (copies queued on a CUDA stream, as the cache's
tickets go) and ``DirectCopies``, the tensor work of the path. Every copy crosses the bus once,
beside the forward rather than inside it, loads and saves on CUDA streams of their own
(``DirectCopies.load_stream``, at the device's highest priority, and ``save_stream``): a load a
request waits for never queues behind the saves of the prompts before it, which run on a
capped grid and take far longer than a load (a load's blocks are never ones a save reads: vLLM
gives a saving request's blocks to another only after the save, ``released``/``preempted``):

- a load copies the host pages a hit holds (``TieredCache.hold_host``: verified, pinned; the
  part only a store held landed there first) into vLLM's blocks, every layer in one launch,
  ordered after the work already queued on the forward's stream (the last user of those
  blocks) and running while the next forwards compute. The request waits for it outside the
  step, as vLLM's asynchronous loads go (``get_num_new_matched_tokens`` answers
  ``load_kv_async``), and runs once the worker reports it received. Whole blocks move, the
  request's last one included when its page is held (the rows past the claim are ones the
  request computes itself afterwards); the host pages stay pinned until the copy is over;
- a save writes the prompt's pages the host tier lacks from vLLM's blocks into host pages
  (``TieredCache.save_host``), every layer in one launch ordered after the forward that
  computed them; they enter kvtier's index when it is over, and go on to the stores from there
  as any host page does. vLLM keeps a finished request's blocks until its saves are over (the
  scheduler half marks it ``held``), and a preempted request's blocks are reused only after
  them (the forward's stream waits for them).

On CUDA the copies are kvtier's row kernel (``transfer.rows``), where vLLM's layout has
contiguous head rows and the kvtier page is one vLLM block (``page_size`` = block size, the
default). Saves write pinned host memory through unified addressing. Loads go through the
copy engines where the host tier's ``copy_path`` allows them (``auto``, the default, or
``copy_engine``; ``page_first`` host layout; a driver with ``cuMemcpyBatchAsync``): whole host
pages into a device buffer of ``host.copy_staging_bytes`` (``BounceLoads``), then the row
kernel device to device into vLLM's blocks, chunk by chunk; a UVA kernel reads host memory at
a rate that depends on the host (about 32 GB/s on the H100 the direct path was measured on,
where the copy engines move about 50: docs/benchmarks-integrations.md). Otherwise torch gathers by
row (vLLM's CPU backend, where host pages are plain memory and copies are over when they
return; on CUDA they go through the host and wait, and the start-up log says so). vLLM keeps
the GPU memory staging pages would take; kvtier's device tier is not used. One worker in the
engine-core process only (refused with tensor parallelism at start). Runs on vLLM's
model-runner thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from kvtier.integrations.vllm.blocks import BlockCopier
from kvtier.integrations.vllm.layout import BlockLayout
from kvtier.integrations.vllm.specs import LoadSpec, SaveSpec
from kvtier.memory.device_pool import torch_dtype
from kvtier.transfer.ce_batch import BatchCopy, load_batch_copy
from kvtier.transfer.staged import merge_runs

log = logging.getLogger(__name__)


def host_kv(host_pool: Any) -> torch.Tensor:
    """The host pool as ``[layers, parts, pages, page_size, heads, head_dim]`` over its bytes
    (either host layout; a strided view, nothing copied)."""
    return pages_kv(host_pool.buffer, host_pool.layout, host_pool.num_pages,
                    host_pool.host_layout)


def pages_kv(buffer: torch.Tensor, layout: Any, num_pages: int,
             host_layout: str = "page_first") -> torch.Tensor:
    """``num_pages`` kvtier pages in ``buffer``'s bytes, laid out as the host pool lays them,
    seen as ``[layers, parts, pages, page_size, heads, head_dim]``."""
    flat = buffer.view(torch_dtype(layout.dtype))
    layers, parts, page, heads, dim = layout.page_shape()
    part = page * heads * dim
    if host_layout == "page_first":
        strides = (parts * part, part, layers * parts * part)
    else:                                       # layer_first
        strides = (num_pages * parts * part, part, parts * part)
    return torch.as_strided(flat, (layers, parts, num_pages, page, heads, dim),
                            (*strides, heads * dim, dim, 1))


def engine_copies(device: torch.device, copy_path: str) -> BatchCopy | None:
    """The copy engines' batched copy for the direct path's loads: on CUDA unless
    ``host.copy_path`` is ``kernel``, where the driver has it; else None."""
    if device.type != "cuda" or copy_path == "kernel":
        return None
    return load_batch_copy()


class DoneTicket:
    """A copy that was over when it returned (the CPU's)."""

    def is_done(self) -> bool:
        return True

    def wait(self, timeout_s: float | None = None) -> bool:
        return True

    def stream_wait(self, device: torch.device) -> None:
        """Nothing to wait for."""


class EventTicket:
    """Copies queued on the current CUDA stream of ``device`` up to now; ``keep`` holds the
    tensors they read (index uploads) until the ticket is dropped."""

    def __init__(self, device: torch.device, keep: tuple[Any, ...] = ()) -> None:
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(device))
        self.keep = keep

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

    def stream_wait(self, device: torch.device) -> None:
        """Make the current stream of ``device`` wait for these copies (no host wait)."""
        torch.cuda.current_stream(device).wait_event(self.event)


Ticket = DoneTicket | EventTicket


def kernels_fit_host(layout: BlockLayout, kv: torch.Tensor, pool: torch.Tensor,
                     page_size: int) -> bool:
    """Whether the row kernel moves whole blocks between ``kv`` and host pages ``pool``: head
    rows contiguous in vLLM's layout, one block per kvtier page, the same dtype."""
    return (layout.rows() is not None and page_size == layout.block_size
            and kv.dtype == pool.dtype)


class BounceLoads:
    """Direct loads through the copy engines: whole host pages into a device buffer of
    ``staging_bytes`` (one batched copy a chunk, runs of consecutive pages joined), then the
    row kernel from there into vLLM's blocks, chunk after chunk on the current stream (a chunk
    never overwrites what the one before still reads)."""

    def __init__(self, host_pool: Any, layout: BlockLayout, kv_caches: list[torch.Tensor],
                 batch: BatchCopy, staging_bytes: int) -> None:
        if host_pool.host_layout != "page_first":
            raise ValueError("copy-engine loads need the page_first host layout")
        self.page_bytes = host_pool.layout.page_bytes
        self.pages = max(1, staging_bytes // self.page_bytes)
        self.device = kv_caches[0].device
        self.buffer = torch.empty(self.pages * self.page_bytes, dtype=torch.uint8,
                                  device=self.device)
        self.copier = BlockCopier(layout, pages_kv(self.buffer, host_pool.layout, self.pages),
                                  device=self.device)
        self.kv_caches = kv_caches
        self.batch = batch
        self._host_base = np.uint64(host_pool.buffer.data_ptr())

    def load(self, pages: np.ndarray, blocks: np.ndarray) -> list[torch.Tensor]:
        """Queue host ``pages`` into vLLM ``blocks`` (one block a page); returns the index
        tensors the queued copies read."""
        stream = int(torch.cuda.current_stream(self.device).cuda_stream) \
            if self.device.type == "cuda" else 0
        unit, base = np.uint64(self.page_bytes), np.uint64(self.buffer.data_ptr())
        kept = []
        for lo in range(0, len(pages), self.pages):
            chunk = np.asarray(pages[lo:lo + self.pages], dtype=np.uint64)
            slots = np.arange(len(chunk), dtype=np.uint64)
            self.batch.copy(*merge_runs(base + slots * unit, self._host_base + chunk * unit,
                                        np.full(len(chunk), unit, dtype=np.uint64)), stream)
            plan = self.copier.plan("load", slots.astype(np.int64), blocks[lo:lo + len(chunk)])
            ids = self.copier.ids(plan, self.device)
            self.copier.copy_layers(plan, self.kv_caches, ids)
            kept.append(ids)
        return kept


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
        # Saves run beside the forwards that follow: their grid is the host tier's store cap
        # (``host.store_programs``; the connector's default, 4, and why, are in ``options``),
        # where one program per SM slowed vLLM alone's batch of misses to 0.957x on an H100
        # (vllm_gpu_h100_direct.txt). Loads keep one per SM: the request waits for them.
        store_cap = runtime.options.config.host.store_programs or None
        self.blocks = (BlockCopier(layout, self.pool, device=self.device,
                                   store_programs=store_cap)
                       if wanted and fits else None)
        #: The path's copies run here, beside the forward (CUDA; None on the CPU): loads on a
        #: stream of the highest priority (a request waits for them), saves on their own.
        self.load_stream = self.save_stream = None
        if self.device.type == "cuda":
            # torch maps a priority past the device's range to the nearest one: the highest
            self.load_stream = torch.cuda.Stream(self.device, priority=-(1 << 16))
            self.save_stream = torch.cuda.Stream(self.device)
        host = runtime.options.config.host
        batch = engine_copies(self.device, host.copy_path)
        #: Loads through the copy engines (see the module docstring), else the row kernel.
        self.bounce = (BounceLoads(runtime.cache.host_pool, layout, kv_caches, batch,
                                   host.copy_staging_bytes)
                       if self.blocks is not None and batch is not None
                       and runtime.cache.host_pool.host_layout == "page_first" else None)
        if host.copy_path == "copy_engine" and self.bounce is None:
            log.warning("kvtier connector: copy_path copy_engine: the direct path's loads use "
                        "%s (copy engines need CUDA, the page_first host layout, a driver "
                        "with cuMemcpyBatchAsync and the row kernel's layouts)", self.by)

    @property
    def by(self) -> str:
        if self.blocks is None:
            return "torch gathers"
        if self.bounce is not None:
            return "the copy engines and the row kernel (loads), the row kernel (saves)"
        return "the row kernel over pinned host memory"

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
        if self.bounce is not None:             # its device-to-device geometry
            self.bounce.copier.save(0, np.array([0]), np.array([0]), kv)
            self.bounce.copier.load(0, np.array([0]), np.array([0]), kv)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def _beside(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        """Queue the block of copies on ``stream``, after everything the forward's stream
        holds now (on the CPU, None: right here)."""
        if stream is None:
            yield
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield

    def _ticket(self, keep: tuple[Any, ...] = ()) -> Ticket:
        return EventTicket(self.device, keep) if self.device.type == "cuda" else DoneTicket()

    # ---- loads -------------------------------------------------------------------------------
    def load(self, spec: LoadSpec, held: Any) -> Ticket:
        """Queue the copy of ``spec``'s tokens (whole blocks: see the module docstring) from
        the held host pages into vLLM's blocks; the ticket says when it is over."""
        rows, slots, whole = self.plan_load(spec, held)
        with self._beside(self.load_stream):
            kept: list[Any] = []
            if whole is not None and self.bounce is not None:
                kept = self.bounce.load(*whole)
            elif whole is not None:
                assert self.blocks is not None
                plan = self.blocks.plan("load", *whole)
                kept = [self.blocks.ids(plan, self.device)]
                self.blocks.copy_layers(plan, self.kv_caches, kept[0])
            if len(rows):
                self._load_rows(rows, slots)
            return self._ticket(tuple(kept))

    def plan_load(self, spec: LoadSpec, held: Any) -> tuple[torch.Tensor, torch.Tensor,
                                                           tuple[np.ndarray, np.ndarray] | None]:
        """Rows to copy by row (host rows ``page * page_size + offset``, vLLM slots) and the
        host pages and vLLM blocks the kernel moves whole (one block a page). The claim's last
        block is copied whole: held pages are whole pages, so its page is held."""
        page, block = self.runtime.page_size, self.layout.block_size
        end = -(-spec.end // block) * block
        tokens = torch.arange(spec.start, end)
        pages = torch.tensor(held.host_page_ids, dtype=torch.long)
        rows = pages[tokens // page] * page + tokens % page
        table = torch.tensor(spec.block_ids, dtype=torch.long)
        slots = table[tokens // block] * block + tokens % block
        if self.blocks is None:
            return rows, slots, None
        first, stop = -(-spec.start // block), end // block      # whole blocks
        moved = (tokens >= first * block) & (tokens < stop * block)
        whole = (pages[first:stop].numpy(), np.asarray(spec.block_ids[first:stop])) \
            if stop > first else None
        return rows[~moved], slots[~moved], whole

    def _load_rows(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Rows of every layer by gathers: one read of the host pool, one upload."""
        page = self.runtime.page_size
        picked = self.pool[:, :, rows // page, rows % page]   # [layers, 2, n, heads, dim]
        if self.device.type == "cuda":
            picked = picked.pin_memory().to(self.device, non_blocking=True)
        on_device = slots.to(self.device, non_blocking=True)
        for layer, kv in enumerate(self.kv_caches):
            self.layout.write(kv, on_device, picked[layer, 0], picked[layer, 1])

    # ---- saves -------------------------------------------------------------------------------
    def save(self, spec: SaveSpec) -> Ticket:
        """Store ``spec``'s full pages the host tier lacks from vLLM's blocks into host pages;
        the ticket says when the blocks have been read (done at once when nothing was copied:
        held already, or no room on host)."""
        rt = self.runtime
        tickets: list[Ticket] = []

        def fill(first: int, host_ids: list[int]) -> Ticket:
            with self._beside(self.save_stream):
                ids = self._copy_out(spec, first, host_ids)
                tickets.append(self._ticket((ids,)))
            rt.counts["saved_tokens"] += len(host_ids) * rt.page_size
            return tickets[0]

        with rt.lock:
            pages = rt.cache.save_host(list(spec.tokens), fill, spec.salt)
            if not pages:
                rt.counts["saves_refused_no_host_room"] += 1
            elif not tickets:
                rt.counts["saves_skipped_held"] += 1
        return tickets[0] if tickets else DoneTicket()

    def _copy_out(self, spec: SaveSpec, first: int, host_ids: list[int]) -> Any:
        """Pages ``[first, first + len(host_ids))`` of ``spec`` into ``host_ids``, every layer;
        returns the tensors the queued copy reads."""
        page, block = self.runtime.page_size, self.layout.block_size
        if self.blocks is not None:           # one block per page
            blocks = np.asarray(spec.block_ids[first:first + len(host_ids)])
            plan = self.blocks.plan("store", blocks, np.asarray(host_ids))
            ids = self.blocks.ids(plan, self.device)
            self.blocks.copy_layers(plan, self.kv_caches, ids)
            return ids
        tokens = torch.arange(first * page, (first + len(host_ids)) * page)
        table = torch.tensor(spec.block_ids, dtype=torch.long)
        slots = (table[tokens // block] * block + tokens % block).to(self.device)
        at = (torch.tensor(host_ids, dtype=torch.long)[tokens // page - first], tokens % page)
        for layer, kv in enumerate(self.kv_caches):
            keys, values = self.layout.read(kv, slots)
            self.pool[layer, 0][at] = keys.to("cpu", self.pool.dtype)
            self.pool[layer, 1][at] = values.to("cpu", self.pool.dtype)
        return slots
