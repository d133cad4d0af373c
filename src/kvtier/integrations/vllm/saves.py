"""Storing one prompt's KV from vLLM's blocks into kvtier: plan, copy layer by layer, commit.

Owns ``PromptSave`` (one prompt being stored) and ``SaveCopier`` (the tensor work on it):

- ``plan(spec)`` takes staging pages for the full kvtier pages kvtier does not hold on its
  device tier yet (pages it holds there are reused; none free, even once ``allocate`` has
  reaped finished host copies: the save is refused, counted and logged at the 1st, 2nd, 4th,
  ... refusal); when the host tier holds more of the prompt than the device tier (a finished
  request whose prompt was stored at its prefill and has left kvtier's device tier since), only
  for the pages past the host's, which then go to host alone (``TieredCache.commit_tail``,
  counted ``saves_to_host_only``) instead of the whole prompt through the device tier; and
  skips the prompt outright when kvtier already holds every full page on some tier (no copy,
  no commit: counted ``saves_skipped_held``);
- ``copy_all(save)`` (or ``copy_layer(save, layer)``, one layer) gathers the rows by slot from
  vLLM's KV tensors into the staging pages, in kvtier's canonical row order (``layout``): one
  launch of kvtier's row kernel over whole blocks of every layer where ``blocks`` applies
  (CUDA, a vLLM layout whose head rows are contiguous, page size a multiple of the block
  size; ``copy_layer``: one launch per layer); else, layer by layer, on the
  CPU with whole blocks, one copy per block straight into its page; else one gather and one
  scatter (of whole blocks when the page size is a multiple of the block size, else of token
  rows);
- ``commit(save)`` hands the pages to ``TieredCache.commit`` (write policy: host copy, store
  backups on kvtier's IO threads; the index's moves become KV events, ``events``), or a
  host-only save's to ``TieredCache.commit_tail``;
  ``abandon(save)`` frees them.

Which thread calls what is the caller's business: on the CPU the background saver thread
(``saver``) does all three; on CUDA the model runner does all three once the forward is queued
(``worker``), its copies and the host copy the commit starts ordered on the forward's stream.
Every cache call takes the runtime's lock; the copies do not, since staging pages handed out by
``allocate`` belong to the save until it commits or abandons them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.errors import KvtierError
from kvtier.integrations.vllm.blocks import BlockCopier, block_view, sub_pages
from kvtier.integrations.vllm.layout import BlockLayout
from kvtier.integrations.vllm.runtime import ConnectorRuntime
from kvtier.integrations.vllm.specs import SaveSpec

log = logging.getLogger(__name__)


@dataclass(eq=False)
class PromptSave:
    """One prompt on its way into kvtier (see the module docstring)."""

    spec: SaveSpec
    rows: torch.Tensor                 # rows in kvtier's staging pool to fill
    slots: torch.Tensor                # the same tokens' slots in vLLM's blocks (both host
                                       # tensors until the row path uploads them)
    page_ids: list[int]                # the pages committed, in prefix order: the device head
                                       # reused, then ``fresh`` (a tail save: ``fresh`` only)
    fresh: list[int]                   # the staging pages this save allocated
    first: int = 0                     # the first page copied (the head before it is held)
    #: The head is held on host only: the copied pages go to host (``TieredCache.commit_tail``),
    #: not to kvtier's device tier, so the head is not copied again.
    tail: bool = False
    #: With kvtier pages a whole number of vLLM's blocks: the blocks and the sub-pages
    #: (``blocks.block_view``) they fill, so a layer moves as whole blocks
    #: (``rows``/``slots`` serve any other page size).
    blocks: torch.Tensor | None = None
    pages: torch.Tensor | None = None
    kernel_plan: Any = None            # the kernels' checked copy of every layer, and its
    kernel_ids: Any = None             # block and page ids on the device (made at the first copy)
    layers_copied: int = 0
    copy_cpu_us: int = 0               # CPU time of its layer copies, counted at commit
    handles: list[Any] = field(default_factory=list)   # Loaded handles released after commit

    @property
    def req_id(self) -> str:
        return self.spec.req_id


class SaveCopier:
    """The tensor work of saves over one runtime and vLLM's registered KV tensors."""

    def __init__(self, runtime: ConnectorRuntime, kv_caches: dict[str, torch.Tensor] | None,
                 layout: BlockLayout | None, blocks: BlockCopier | None = None) -> None:
        """``kv_caches`` None: the copies run in worker processes (``rank_steps`` plans
        and commits through this copier, and never calls ``copy_layer``)."""
        self.runtime = runtime
        names = runtime.shape.layer_names
        self.kv_caches = [kv_caches[name] for name in names] if kv_caches is not None else []
        self.layout = layout
        self.blocks = blocks            # whole-block kernel copies, where they apply
        #: A save whose head kvtier holds on host but not on its device tier copies only its
        #: new pages (``commit_tail``); not where the copies run in rank processes.
        self.tail_saves = kv_caches is not None and runtime.cache.tail_commits

    @property
    def num_layers(self) -> int:
        return len(self.runtime.shape.layer_names)

    def plan(self, spec: SaveSpec, handles: list[Any] | None = None) -> PromptSave | None:
        """Staging pages and row indices for ``spec``; None when nothing is to be done.
        ``handles`` (the request's loads this step, which pin its head on kvtier's device
        tier) are released once the save commits or gives up."""
        started = time.thread_time()
        try:
            return self._plan(spec, list(handles or ()))
        finally:
            with self.runtime.lock:
                self.runtime.counts["save_plan_cpu_us"] += int(
                    (time.thread_time() - started) * 1e6)

    def _plan(self, spec: SaveSpec, handles: list[Any]) -> PromptSave | None:
        rt, page = self.runtime, self.runtime.page_size
        full = len(spec.tokens) // page
        with rt.lock:
            hit = rt.cache.match(spec.tokens, spec.salt)
            on_host = rt.cache.host_pages(hit) if self.tail_saves else 0
            if hit.tokens >= full * page or on_host >= full:
                rt.counts["saves_skipped_held"] += 1
                self._release(handles)
                return None
            on_device = hit.tokens_by_tier.get("device", 0) // page
            tail = on_host > on_device    # only the new pages, to host
            found = (self._tail_pages(full - on_host) if tail
                     else self._staging_pages(spec, full, on_device))
            if found is None:
                rt.counts["saves_refused_no_staging"] += 1
                self._warn_refused(full - max(on_device, on_host))
                self._release(handles)
                return None
            held, fresh = found
            first = on_host if tail else len(held)
        tokens = torch.arange(first * page, full * page)
        rows = torch.tensor(fresh, dtype=torch.long)[tokens // page - first] * page + tokens % page
        block = rt.shape.block_size
        table = torch.tensor(spec.block_ids, dtype=torch.long)
        slots = table[tokens // block] * block + tokens % block
        save = PromptSave(spec, rows, slots, held + fresh, fresh, first, tail, handles=handles)
        if page % block == 0:           # whole blocks into sub-pages (``block_view``)
            per_page = page // block
            save.blocks = table[first * per_page:full * per_page]
            save.pages = sub_pages(torch.tensor(fresh, dtype=torch.long), page, block)
        return save

    def _tail_pages(self, wanted: int) -> tuple[list[int], list[int]] | None:
        """Staging pages for a tail save's ``wanted`` new pages. Runs under the runtime's lock."""
        try:
            return [], self.runtime.cache.allocate(wanted)
        except (KvtierError, MemoryError):
            return None

    def _warn_refused(self, wanted: int) -> None:
        """Say so when a save is refused for want of staging pages: the 1st, 2nd, 4th, 8th, ...
        time (a steady stream of refusals stays visible without flooding the log)."""
        refused = self.runtime.counts["saves_refused_no_staging"]
        if refused & (refused - 1) == 0:
            log.warning("kvtier: a prompt was not stored: it needed %d staging pages and fewer "
                        "were free (%d in all, held by loads and saves in flight); %d saves "
                        "refused so far (saves_refused_no_staging). A larger staging_pages "
                        "keeps them.", wanted, self.runtime.cache.device_pool.num_pages,
                        refused)

    def _staging_pages(self, spec: SaveSpec, full: int,
                       on_device: int) -> tuple[list[int], list[int]] | None:
        """The pages of ``spec``'s ``full`` pages kvtier's device tier holds (its head) and
        fresh staging pages for the rest, or None when the pool cannot give them. The head's
        pages need none: only the part past them is allocated (a prompt whose prefix a load
        pins on the device would otherwise need room for all of it). Allocating may evict
        head pages that nothing pins, so the match is taken again after it; if it shrank,
        the whole prompt is allocated instead. Runs under the runtime's lock."""
        cache, page = self.runtime.cache, self.runtime.page_size
        for want in dict.fromkeys((full - on_device, full)):     # the tail first, then all
            try:
                fresh = cache.allocate(want)
            except (KvtierError, MemoryError):
                continue
            hit = cache.match(spec.tokens, spec.salt)
            held = list(hit.device_page_ids[: hit.tokens_by_tier.get("device", 0) // page])
            if len(held) + len(fresh) < full:                    # eviction took some of it
                cache.free(fresh)
                continue
            extra = len(held) + len(fresh) - full
            cache.free(fresh[:extra])
            return held, fresh[extra:]
        return None

    def copy_all(self, save: PromptSave) -> None:
        """Copy every layer of ``save``'s rows into the staging pages: one launch of the block
        kernel for all layers where it applies, else layer by layer (``copy_layer``)."""
        if not self._kernel_copies(save):
            for layer in range(self.num_layers):
                self.copy_layer(save, layer)
            return
        started = time.thread_time()
        assert self.blocks is not None and save.kernel_plan is not None
        self.blocks.copy_layers(save.kernel_plan, self.kv_caches, save.kernel_ids)
        save.layers_copied = self.num_layers
        save.copy_cpu_us += int((time.thread_time() - started) * 1e6)

    def _kernel_copies(self, save: PromptSave) -> bool:
        """Whether the block kernel copies ``save`` (its plan made and uploaded once)."""
        if save.blocks is None or save.pages is None or self.blocks is None:
            return False
        if save.kernel_plan is None:
            save.kernel_plan = self.blocks.plan("store", save.blocks.numpy(), save.pages.numpy())
            save.kernel_ids = self.blocks.ids(save.kernel_plan, self.blocks.device)
        return True

    def copy_layer(self, save: PromptSave, layer: int, kv_layer: torch.Tensor | None = None) -> None:
        """Copy layer ``layer`` of ``save``'s rows from vLLM's tensor into the staging pages."""
        started = time.thread_time()
        kv = self.kv_caches[layer] if kv_layer is None else kv_layer
        assert self.layout is not None
        pool = self.runtime.cache.device_pool.kv
        if save.blocks is not None:
            pool = block_view(pool, self.layout.block_size)
        if self._kernel_copies(save):
            assert self.blocks is not None and save.kernel_plan is not None
            self.blocks.copy(save.kernel_plan, layer, kv, save.kernel_ids)
        elif save.blocks is not None and kv.device.type == "cpu" == pool.device.type:
            self._copy_blocks_on_cpu(save, layer, kv, pool)
        elif save.blocks is not None:
            keys, values = self.layout.read_blocks(kv, save.blocks.to(kv.device))
            pages = save.pages.to(pool.device)
            pool[layer, 0].index_copy_(0, pages, keys.to(pool.dtype))
            pool[layer, 1].index_copy_(0, pages, values.to(pool.dtype))
        else:
            if save.rows.device != pool.device:     # uploaded once, at the first layer
                save.rows = save.rows.to(pool.device, non_blocking=True)
                save.slots = save.slots.to(kv.device, non_blocking=True)
            keys, values = self.layout.read(kv, save.slots)
            pool[layer, 0].flatten(0, 1)[save.rows] = keys
            pool[layer, 1].flatten(0, 1)[save.rows] = values
        save.layers_copied = layer + 1
        save.copy_cpu_us += int((time.thread_time() - started) * 1e6)

    def _copy_blocks_on_cpu(self, save: PromptSave, layer: int, kv: torch.Tensor,
                            pool: torch.Tensor) -> None:
        """Each block straight into its page: no gathered temporary (a fresh 6 MB allocation per
        layer, whose page faults cost as much as the copy) and no second pass over it."""
        assert save.pages is not None and save.blocks is not None
        keys, values = self.layout.views(kv)        # [blocks, block_size, heads, head_dim]
        for block, page in zip(save.blocks.tolist(), save.pages.tolist(), strict=True):
            pool[layer, 0, page].copy_(keys[block])
            pool[layer, 1, page].copy_(values[block])

    def commit(self, save: PromptSave) -> None:
        """Index and write the copied pages (the write policy takes over from here)."""
        rt, started = self.runtime, time.thread_time()
        with rt.lock:
            rt.counts["save_copy_cpu_us"] += save.copy_cpu_us
            if save.layers_copied < self.num_layers:
                rt.counts["saves_incomplete"] += 1
                self._free(save)
                return
            if save.tail:
                if not rt.cache.commit_tail(list(save.spec.tokens), save.fresh, save.first,
                                            save.spec.salt):
                    rt.counts["saves_refused_host_moved"] += 1    # the cache freed the pages
                    self._release_handles(save)
                    return
                rt.counts["saves_to_host_only"] += 1
            else:
                try:
                    rt.cache.commit(list(save.spec.tokens), save.page_ids, save.spec.salt)
                except ValueError:      # a reused staging page was evicted under the save
                    rt.counts["saves_refused_evicted"] += 1
                    self._free(save)
                    return
            rt.counts["saved_tokens"] += len(save.rows)
            self._release_handles(save)
            rt.cache.poll()
            rt.counts["save_commit_cpu_us"] += int((time.thread_time() - started) * 1e6)

    def abandon(self, save: PromptSave) -> None:
        """Give the save's staging pages back (dropped or cancelled before its commit)."""
        with self.runtime.lock:
            self.runtime.counts["save_copy_cpu_us"] += save.copy_cpu_us
            self._free(save)

    def _free(self, save: PromptSave) -> None:
        self.runtime.cache.free(save.fresh)
        self._release_handles(save)

    def _release_handles(self, save: PromptSave) -> None:
        self._release(save.handles)
        save.handles.clear()

    def release(self, handles: list[Any]) -> None:
        """Release load handles a save was given but will not use."""
        with self.runtime.lock:
            self._release(handles)

    def _release(self, handles: list[Any]) -> None:
        for handle in handles:
            self.runtime.cache.release(handle)
