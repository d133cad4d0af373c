"""The worker half of kvtier's vLLM connector in a worker process of its own (a TP rank).

Owns ``RankWorker``. The cache is in the engine-core process; this rank maps its staging pool
(``shared_pool``, named by each step's metadata) and copies its KV heads' slice
(``ModelShape.rank_heads``) of the pages the step names (``rank_steps``):

- loads: ``wait_for_layer_load(layer)`` copies that layer's rows of the staged pages into vLLM's
  blocks just before its attention runs (the pages were read and verified before the scheduler
  claimed the hit);
- saves: ``wait_for_save`` copies, after the forward wrote them, the save's rows of every layer
  out of vLLM's blocks into the staging pages (whole blocks when kvtier pages are as large as
  vLLM's blocks); of ranks holding the same replicated heads only the first writes;
- ``get_finished`` reports the finished requests whose blocks vLLM kept for this step's copies,
  and ``build_worker_meta`` the step as run (or failed) for ``RankedSteps`` to end it.

The copies are synchronous (on CUDA each layer's rows go through one host gather and one
blocking transfer), so a step this rank reports is over. A step whose pool cannot be mapped
reports its loads' blocks as load errors (vLLM recomputes them) and the step as failed. Runs on
vLLM's model-runner thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.integrations.vllm.layout import BlockLayout, registered_layout
from kvtier.integrations.vllm.rank_steps import KvtierWorkerMeta
from kvtier.integrations.vllm.runtime import RankRuntime
from kvtier.integrations.vllm.shared_pool import PoolRef, attach
from kvtier.integrations.vllm.specs import LoadSpec, SaveSpec

log = logging.getLogger(__name__)


@dataclass
class _Rows:
    """Token rows to move: ``rows`` in the staging pool, ``slots`` in vLLM's blocks."""

    rows: torch.Tensor
    slots: torch.Tensor


class RankWorker:
    """See the module docstring."""

    def __init__(self, runtime: RankRuntime, rank: int) -> None:
        self.runtime = runtime
        self.rank = rank
        shape = runtime.shape
        self.heads = shape.rank_heads(rank)
        self.writes = shape.writes_heads(rank)
        self.kv_caches: list[torch.Tensor] = []
        self.layout: BlockLayout | None = None
        self._layer_index = {name: i for i, name in enumerate(shape.layer_names)}
        self._pool: torch.Tensor | None = None
        self._pool_ref: PoolRef | None = None
        self._meta: Any = None
        self._loads: list[_Rows] = []
        self._copied: set[int] = set()           # layers of this step's loads already copied
        self._failed = False
        self._load_errors: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], backend: str,
                           cpu_write_op: Any = None) -> None:
        shape = self.runtime.shape
        layout = registered_layout(kv_caches, shape.layer_names, backend,
                                   shape.rank_kv_heads or shape.kv_heads, shape.head_dim,
                                   cpu_write_op, shape.block_size)
        self.kv_caches = [kv_caches[name] for name in shape.layer_names]
        self.layout = layout
        log.info("kvtier connector rank %d: %s KV layout, heads [%d, %d) of %d, copies through "
                 "the shared staging pool", self.rank, layout.kind, *self.heads, shape.kv_heads)

    # ---- the step --------------------------------------------------------------------------
    def start_load_kv(self, meta: Any) -> None:
        self._meta, self._copied, self._failed = meta, set(), False
        self._loads = []
        if not meta.loads and not meta.saves:
            return
        if self._map(meta.pool) is None:
            self._fail(meta.loads)
            return
        for spec in meta.loads:
            if not spec.pages or spec.page_start > spec.start:
                self._fail([spec])
                continue
            self._loads.append(self._rows(spec.start, spec.end, spec.pages, spec.page_start,
                                          spec.block_ids))

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is None or not self._loads or layer in self._copied:
            return
        self._copy_loads(layer)

    def _copy_loads(self, layer: int) -> None:
        assert self._pool is not None and self.layout is not None
        first, end = self.heads
        kv = self.kv_caches[layer]
        for move in self._loads:
            keys = self._pool[layer, 0].flatten(0, 1)[move.rows, first:end]
            values = self._pool[layer, 1].flatten(0, 1)[move.rows, first:end]
            self.layout.write(kv, move.slots.to(kv.device), keys.to(kv.device),
                              values.to(kv.device))
        self._copied.add(layer)

    def load_all_layers(self) -> None:
        """Copy every layer of the step's loads before the forward (a full CUDA graph replays
        it without calling ``wait_for_layer_load``)."""
        for layer in range(len(self.kv_caches)):
            if self._loads and layer not in self._copied:
                self._copy_loads(layer)

    def save_kv_layer(self, meta: Any, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Nothing: a rank copies its saves after the forward (``wait_for_save``)."""

    def wait_for_save(self, meta: Any) -> None:
        """Finish the step's loads (layers the forward did not reach) and copy its saves."""
        if meta is not self._meta:       # a step whose loads were not started (no forward)
            self.start_load_kv(meta)
        for layer in range(len(self.kv_caches)):
            if self._loads and layer not in self._copied:
                self._copy_loads(layer)
        if not self.writes or not meta.saves or self._failed:
            return
        if self._map(meta.pool) is None:
            self._failed = True
            return
        for spec in meta.saves:
            self._copy_save(spec)

    def _copy_save(self, spec: SaveSpec) -> None:
        assert self._pool is not None and self.layout is not None
        page, block = self.runtime.page_size, self.runtime.shape.block_size
        end = len(spec.tokens) // page * page
        if spec.start >= end:
            return
        first, last = self.heads
        if page == block:                # whole blocks straight into their pages
            pages = spec.pages[spec.start // page:]
            blocks = spec.block_ids[spec.start // block:end // block]
            for layer, kv in enumerate(self.kv_caches):
                keys, values = self.layout.views(kv)
                for b, p in zip(blocks, pages, strict=True):
                    self._pool[layer, 0, p, :, first:last].copy_(keys[b])
                    self._pool[layer, 1, p, :, first:last].copy_(values[b])
            return
        move = self._rows(spec.start, end, spec.pages, 0, spec.block_ids)
        for layer, kv in enumerate(self.kv_caches):
            keys, values = self.layout.read(kv, move.slots.to(kv.device))
            self._pool[layer, 0].flatten(0, 1)[move.rows, first:last] = keys.cpu()
            self._pool[layer, 1].flatten(0, 1)[move.rows, first:last] = values.cpu()

    def get_finished(self, finished_req_ids: set[str]) -> set[str] | None:
        """Finished requests whose blocks vLLM kept for this step's copies, now done."""
        return set(self._meta.held) or None if self._meta is not None else None

    def build_worker_meta(self) -> KvtierWorkerMeta | None:
        meta = self._meta
        if meta is None or getattr(meta, "step", 0) == 0:
            return None
        self._meta = None
        if self._failed:
            return KvtierWorkerMeta(failed={meta.step: 1})
        return KvtierWorkerMeta(done={meta.step: 1})

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- helpers ---------------------------------------------------------------------------
    def _rows(self, start: int, end: int, pages: tuple[int, ...], page_start: int,
              block_ids: tuple[int, ...]) -> _Rows:
        page, block = self.runtime.page_size, self.runtime.shape.block_size
        tokens = torch.arange(start, end)
        ids = torch.tensor(pages, dtype=torch.long)
        rows = ids[(tokens - page_start) // page] * page + tokens % page
        table = torch.tensor(block_ids, dtype=torch.long)
        return _Rows(rows, table[tokens // block] * block + tokens % block)

    def _map(self, ref: PoolRef | None) -> torch.Tensor | None:
        if ref is None:
            return None
        if ref != self._pool_ref:
            try:
                self._pool, self._pool_ref = attach(ref), ref
            except (OSError, ValueError) as exc:
                log.error("kvtier connector rank %d: cannot map the staging pool %s: %s",
                          self.rank, ref.path, exc)
                self.runtime.counts["pool_map_errors"] += 1
                return None
        return self._pool

    def _fail(self, specs: list[LoadSpec]) -> None:
        block = self.runtime.shape.block_size
        self._failed = bool(specs) or self._failed
        for spec in specs:
            self._load_errors.update(spec.block_ids[spec.start // block:(spec.end - 1) // block + 1])
            self.runtime.counts["load_errors"] += 1
