"""The worker half of kvtier's vLLM connector: moves K/V rows between vLLM's blocks and kvtier.

Owns ``WorkerSide``. Runs on vLLM's model-runner thread, inside the forward:

- ``start_load_kv`` turns each ``LoadSpec`` into row indices (source rows in kvtier's staging
  pages, destination slots in vLLM's blocks); vLLM calls it before the forward when the step
  has synchronous loads (kvtier's always are) and after it otherwise;
- ``wait_for_layer_load(layer)`` copies that layer's loaded rows just before its attention runs,
  so loading proceeds layer by layer with the forward;
- ``save_kv_layer(layer)`` copies the layer's rows of prompts being stored right after its
  attention wrote them (the step's first call prepares each ``SaveSpec``: staging pages
  allocated, the pages kvtier already holds reused); ``wait_for_save`` commits them to the
  ``TieredCache``, whose write policy moves them on to the host tier and the stores on kvtier's
  IO threads (the pinned budget, the write admission ring and counted refusals apply; the
  forward never waits on a store).

A load whose staged pages are gone reports its blocks through ``get_block_ids_with_load_errors``
(vLLM then recomputes them, or fails the request under the ``fail`` policy); a save that cannot
get staging pages is skipped and counted. Rows are in kvtier's canonical order
(``vllm_layout``), so stored pages do not depend on the attention backend.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.errors import KvtierError
from kvtier.integrations.vllm_layout import BlockLayout, block_layout, check_cpu_layout
from kvtier.integrations.vllm_runtime import ConnectorRuntime
from kvtier.integrations.vllm_scheduler import KvtierConnectorMetadata, LoadSpec, SaveSpec

log = logging.getLogger(__name__)


@dataclass
class _Move:
    """Rows of one request to move: ``rows`` in kvtier's staging pages, ``slots`` in vLLM's."""

    req_id: str
    rows: torch.Tensor
    slots: torch.Tensor
    handle: Any = None                 # load: the staged Loaded; save: (tokens, salt, page ids)
    layers: set[int] = field(default_factory=set)


class WorkerSide:
    """See the module docstring."""

    def __init__(self, runtime: ConnectorRuntime) -> None:
        self.runtime = runtime
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.layout: BlockLayout | None = None
        self._layer_index = {name: i for i, name in enumerate(runtime.shape.layer_names)}
        self._loads: list[_Move] = []
        self._saves: list[_Move] = []
        self._saves_for: KvtierConnectorMetadata | None = None
        self._load_errors: set[int] = set()

    # ---- set-up ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], backend: str,
                           cpu_write_op: Any = None) -> None:
        shape = self.runtime.shape
        missing = sorted(set(shape.layer_names) - set(kv_caches))
        if missing:
            raise KvtierError(f"vLLM registered no KV cache for layers {missing}")
        first = kv_caches[shape.layer_names[0]]
        layout = block_layout(backend, first, shape.kv_heads, shape.head_dim)
        if layout.kind == "cpu" and cpu_write_op is not None:
            check_cpu_layout(layout, first.dtype, cpu_write_op)
        self.kv_caches = {name: kv_caches[name] for name in shape.layer_names}
        self.layout = layout
        log.info("kvtier connector: %s KV layout, %d blocks of %d tokens", layout.kind,
                 layout.num_blocks, layout.block_size)

    # ---- loads -----------------------------------------------------------------------------
    def start_load_kv(self, meta: KvtierConnectorMetadata) -> None:
        self._loads = [m for m in map(self._plan_load, meta.loads) if m is not None]

    def _plan_load(self, spec: LoadSpec) -> _Move | None:
        loaded = self.runtime.take_staged(spec.req_id)
        if loaded is None or loaded.tokens < spec.end or loaded.start_tokens > spec.start:
            self._fail_load(spec, loaded)
            return None
        page = self.runtime.page_size
        tokens = torch.arange(spec.start, spec.end)
        pages = torch.tensor(loaded.device_page_ids, dtype=torch.long)
        rows = pages[(tokens - loaded.start_tokens) // page] * page + tokens % page
        return _Move(spec.req_id, rows, self._slots(spec.block_ids, tokens), loaded)

    def _fail_load(self, spec: LoadSpec, loaded: Any) -> None:
        block = self.runtime.shape.block_size
        first, last = spec.start // block, (spec.end - 1) // block
        self._load_errors.update(spec.block_ids[first:last + 1])
        self.runtime.counts["load_errors"] += 1
        if loaded is not None:
            with self.runtime.lock:
                self.runtime.cache.release(loaded)

    def _slots(self, block_ids: tuple[int, ...], tokens: torch.Tensor) -> torch.Tensor:
        block = self.runtime.shape.block_size
        table = torch.tensor(block_ids, dtype=torch.long)
        return table[tokens // block] * block + tokens % block

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is None or not self._loads:
            return
        pool = self.runtime.cache.device_pool.kv
        for move in self._loads:
            if layer in move.layers:
                continue
            keys = pool[layer, 0].flatten(0, 1)[move.rows]
            values = pool[layer, 1].flatten(0, 1)[move.rows]
            self.layout.write(self.kv_caches[layer_name], move.slots, keys, values)
            move.layers.add(layer)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- saves -----------------------------------------------------------------------------
    def _plan_save(self, spec: SaveSpec) -> _Move | None:
        rt, page = self.runtime, self.runtime.page_size
        full = len(spec.tokens) // page
        with rt.lock:
            try:
                fresh = rt.cache.allocate(full)
            except (KvtierError, MemoryError):
                rt.counts["saves_refused_no_staging"] += 1
                return None
            hit = rt.cache.match(spec.tokens, spec.salt)
            held = list(hit.device_page_ids[: hit.tokens_by_tier.get("device", 0) // page])
            rt.cache.free(fresh[: len(held)])
        page_ids = held + fresh[len(held):]
        tokens = torch.arange(len(held) * page, full * page)
        ids = torch.tensor(page_ids, dtype=torch.long)
        rows = ids[tokens // page] * page + tokens % page
        return _Move(spec.req_id, rows, self._slots(spec.block_ids, tokens),
                     (spec.tokens, spec.salt, page_ids, fresh[len(held):]))

    def save_kv_layer(self, meta: KvtierConnectorMetadata, layer_name: str,
                      kv_layer: torch.Tensor) -> None:
        started = time.perf_counter()
        layer = self._layer_index.get(layer_name)
        if meta is not self._saves_for:  # first layer of the step: plan its saves
            self._saves_for = meta
            self._saves = [m for m in map(self._plan_save, meta.saves) if m is not None]
        if layer is None or not self._saves:
            return
        pool = self.runtime.cache.device_pool.kv
        for move in self._saves:
            keys, values = self.layout.read(kv_layer, move.slots)
            pool[layer, 0].flatten(0, 1)[move.rows] = keys
            pool[layer, 1].flatten(0, 1)[move.rows] = values
            move.layers.add(layer)
        self.runtime.counts["save_copy_us"] += int((time.perf_counter() - started) * 1e6)

    def wait_for_save(self) -> None:
        started = time.perf_counter()
        self._finish_step()
        self.runtime.counts["save_commit_us"] += int((time.perf_counter() - started) * 1e6)

    def _finish_step(self) -> None:
        rt, layers = self.runtime, len(self._layer_index)
        for move in self._loads:
            with rt.lock:
                rt.cache.release(move.handle)
        self._loads = []
        for move in self._saves:
            tokens, salt, page_ids, fresh = move.handle
            with rt.lock:
                if len(move.layers) < layers:
                    rt.cache.free(fresh)
                    rt.counts["saves_incomplete"] += 1
                    continue
                try:
                    rt.cache.commit(list(tokens), page_ids, salt)
                except ValueError:      # a reused staging page was evicted under the save
                    rt.cache.free(fresh)
                    rt.counts["saves_refused_evicted"] += 1
                    continue
                rt.counts["saved_tokens"] += len(move.rows)
                rt.events.stored(rt.namespace, tokens, salt, rt.page_size)
            rt.cache.poll()
        self._saves, self._saves_for = [], None
