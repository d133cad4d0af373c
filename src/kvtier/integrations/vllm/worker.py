"""The worker half of kvtier's vLLM connector: moves K/V rows between vLLM's blocks and kvtier.

Owns ``WorkerSide``. Runs on vLLM's model-runner thread, inside the forward:

- ``start_load_kv`` turns each ``LoadSpec`` into row indices (source rows in kvtier's staging
  pages, destination slots in vLLM's blocks); vLLM calls it before the forward when the step
  has synchronous loads (kvtier's always are) and after it otherwise;
- ``wait_for_layer_load(layer)`` copies that layer's loaded rows just before its attention runs,
  so loading proceeds layer by layer with the forward (on CUDA first making the forward's stream
  wait for that layer of the host -> staging copy the scheduler left in flight, and the step
  for the whole copies of loads staged for later steps, whose pages other requests may already
  be served from; a finished load whose copy has not landed is released at a later step,
  never waited for on the host): on CUDA, with a layout whose head rows are contiguous and
  kvtier pages a whole number of vLLM's blocks, whole blocks with kvtier's row kernel
  (``blocks``, one launch per layer and request) and only the rows of partly loaded blocks
  by slot; otherwise every row by slot (torch gathers);
- ``wait_for_save`` stores the step's saves (prompts whose prefill completed, and finished
  requests' prompt and output, whose blocks vLLM keeps until ``get_finished`` reports them
  copied: the ``held`` mark). On CUDA
  (``copy_in_step``) it plans them, copies every layer of their rows out of vLLM's blocks
  (stream-ordered after the forward: one kernel launch over every layer, else a gather per
  layer) and commits them
  to the ``TieredCache`` right there: vLLM has queued the whole forward by then, so this CPU
  work runs while the GPU computes, and nothing is left for another thread to hold the
  runtime's lock over when the next request is looked up (the host copy the commit starts is
  ordered after the row copies on the forward's stream). Elsewhere it hands them to the
  runtime's saver thread (``saver``), which copies and commits after the step at idle CPU
  priority; vLLM keeps a finished request's blocks until that copy is over (``get_finished``),
  and ``handle_preemptions`` stops copies of blocks vLLM is about to reuse. The forward never
  waits on a store: a full queue or no staging pages drop the save (counted), and a commit
  that fails is counted (``saves_failed``) and logged, never raised into vLLM.

On the direct path (``runtime.direct``) none of the above runs inside the step: the hooks hand
the step's loads and saves to ``direct_steps.DirectSteps``, which queues them beside the
forward (``direct.DirectCopies``), names the requests whose load is over (``take_received``)
and the finished requests whose blocks its saves have read (``get_finished``).

``register_kv_caches`` launches the block kernels once each way (``_warm_up_blocks``), so
that none is compiled inside a request.

A load whose staged pages are gone reports its blocks through ``get_block_ids_with_load_errors``
(vLLM then recomputes them, or fails the request under the ``fail`` policy). Rows are in
kvtier's canonical order (``layout``), so stored pages do not depend on the attention
backend.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvtier.integrations.vllm.blocks import BlockCopier, block_view, kernels_fit
from kvtier.integrations.vllm.direct import DirectCopies
from kvtier.integrations.vllm.direct_steps import DirectSteps
from kvtier.integrations.vllm.layout import BlockLayout, registered_layout
from kvtier.integrations.vllm.runtime import ConnectorRuntime
from kvtier.integrations.vllm.saves import SaveCopier
from kvtier.integrations.vllm.specs import LoadSpec
from kvtier.transfer.plan import CopyPlan

if TYPE_CHECKING:
    from kvtier.integrations.vllm.scheduler import KvtierConnectorMetadata

log = logging.getLogger(__name__)


@dataclass
class _Move:
    """Rows of one request to move: ``rows`` in kvtier's staging pages, ``slots`` in vLLM's;
    with the block kernels, whole blocks by ``plan`` (``ids``: its ids, uploaded once) and only
    the rows of partly loaded blocks by slot."""

    req_id: str
    rows: torch.Tensor
    slots: torch.Tensor
    handle: Any = None                 # load: the staged Loaded; save: (tokens, salt, page ids)
    layers: set[int] = field(default_factory=set)
    plan: CopyPlan | None = None
    ids: torch.Tensor | None = None


class WorkerSide:
    """See the module docstring."""

    def __init__(self, runtime: ConnectorRuntime, copy_in_step: bool = False,
                 use_kernels: bool | None = None) -> None:
        self.runtime = runtime
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.layout: BlockLayout | None = None
        self._layer_index = {name: i for i, name in enumerate(runtime.shape.layer_names)}
        self._loads: list[_Move] = []
        self._load_errors: set[int] = set()
        self._finished: set[str] = set()       # finished requests vLLM told us about
        self._copied: set[str] = set()         # finished requests whose held blocks are copied
        #: Loads the step is done with whose host -> pool copy had not landed when it ended:
        #: released at a later step (releasing now would wait on the host for the copy).
        self._landing: list[Any] = []
        #: Saves copy and commit inside the step on CUDA (stream-ordered); elsewhere the
        #: saver thread does both.
        self.copy_in_step = copy_in_step
        self.copier: SaveCopier | None = None
        #: Whole blocks move with kvtier's transfer kernels (``blocks``) where the layout
        #: allows; None: on CUDA only (tests pass True to run them under TRITON_INTERPRET=1).
        self.use_kernels = use_kernels
        self.blocks: BlockCopier | None = None
        #: The direct path's copies (``runtime.direct``): vLLM's blocks <-> host pages.
        self.direct: DirectCopies | None = None
        #: The direct path's part of each step (its loads, saves and releases).
        self.steps: DirectSteps | None = None

    # ---- set-up ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], backend: str,
                           cpu_write_op: Any = None) -> None:
        shape = self.runtime.shape
        layout = registered_layout(kv_caches, shape.layer_names, backend, shape.kv_heads,
                                   shape.head_dim, cpu_write_op, shape.block_size)
        first = kv_caches[shape.layer_names[0]]
        self.kv_caches = {name: kv_caches[name] for name in shape.layer_names}
        self.layout = layout
        if self.runtime.direct:
            self._register_direct(layout, first)
            return
        pool = self.runtime.cache.device_pool.kv
        wanted = first.device.type == "cuda" if self.use_kernels is None else self.use_kernels
        fits = all(kernels_fit(layout, kv, pool, self.runtime.page_size)
                   for kv in self.kv_caches.values())
        self.blocks = (BlockCopier.for_device_pool(layout, block_view(pool, layout.block_size))
                       if wanted and fits else None)
        self.copier = SaveCopier(self.runtime, self.kv_caches, layout, self.blocks)
        self.runtime.saver.copier = self.copier
        if self.blocks is not None:
            self._warm_up_blocks(first)
        log.info("kvtier connector: %s KV layout (%s), %d blocks of %d tokens, copies by %s",
                 layout.kind, layout.name or "vLLM's CPU blocks", layout.num_blocks,
                 layout.block_size,
                 "transfer kernels" if self.blocks is not None else "torch gathers")

    def _register_direct(self, layout: BlockLayout, first: torch.Tensor) -> None:
        self.direct = DirectCopies(self.runtime, list(self.kv_caches.values()), layout,
                                   self.use_kernels)
        self.blocks = self.direct.blocks
        self.steps = DirectSteps(self.runtime, self.direct, self._fail_load, self._save_failed)
        self.copier = SaveCopier(self.runtime, self.kv_caches, layout, None)
        try:
            self.direct.warm_up()
        except Exception as exc:        # the engine starts regardless
            log.warning("kvtier connector: the direct copies' warm-up failed (%s); they "
                        "compile at first use", exc)
        log.info("kvtier connector: %s KV layout (%s), %d blocks of %d tokens, direct to host "
                 "pages by %s", layout.kind, layout.name or "vLLM's CPU blocks",
                 layout.num_blocks, layout.block_size, self.direct.by)

    def _warm_up_blocks(self, kv: torch.Tensor) -> None:
        """Launch the block kernels once each way before the first request (vLLM warns of a
        kernel compiled during inference, and the first hit would pay for it): vLLM's block 0
        of the first layer goes into a kvtier page taken from the free pool and comes back
        unchanged, and the page goes back. A failure is logged; the first copy compiles them."""
        assert self.blocks is not None
        rt, block = self.runtime, self.runtime.shape.block_size
        taken: list[int] = []
        try:
            with rt.lock:
                taken = rt.cache.allocate(1)
            sub_page = np.array([taken[0] * (rt.page_size // block)])
            self.blocks.save(0, np.array([0]), sub_page, kv)
            self.blocks.load(0, sub_page, np.array([0]), kv)
            if kv.device.type == "cuda":
                torch.cuda.synchronize(kv.device)
        except Exception as exc:        # the engine starts regardless
            log.warning("kvtier connector: the block kernels' warm-up failed (%s); they "
                        "compile at first use", exc)
        finally:
            if taken:
                with rt.lock:
                    rt.cache.free(taken)

    # ---- loads -----------------------------------------------------------------------------
    def start_load_kv(self, meta: KvtierConnectorMetadata) -> None:
        self._release_landed()
        if self.steps is not None:
            self.steps.start_loads(meta.loads)
            return
        self._loads = [m for m in map(self._plan_load, meta.loads) if m is not None]
        self._wait_for_other_copies()

    def _wait_for_other_copies(self) -> None:
        """Order this step after every copy still in flight for loads staged but not run yet.

        Staged pages enter kvtier's device tier at once, so a request staged later can be
        served from them without a copy (and without a ticket) and run in an earlier step than
        the request whose copy fills them: this step's stream then waits for those copies whole.
        """
        rt = self.runtime
        if not rt.staged or self.direct is not None:   # direct: nothing shares staged pages
            return
        with rt.lock:
            tickets = [loaded.ticket for loaded in rt.staged.values()]
        for ticket in tickets:
            if ticket is not None and not ticket.is_done():
                ticket.stream_wait()

    def take_received(self) -> set[str] | None:
        """Direct path: requests whose load is over or failed (``DirectSteps``)."""
        return self.steps.take_received() if self.steps is not None else None

    def _plan_load(self, spec: LoadSpec) -> _Move | None:
        loaded = self.runtime.take_staged(spec.req_id)
        if loaded is None or loaded.tokens < spec.end or loaded.start_tokens > spec.start:
            self._fail_load(spec, loaded)
            return None
        page = self.runtime.page_size
        tokens = torch.arange(spec.start, spec.end)
        pages = torch.tensor(loaded.device_page_ids, dtype=torch.long)
        rows = pages[(tokens - loaded.start_tokens) // page] * page + tokens % page
        slots = self._slots(spec.block_ids, tokens)
        if self.blocks is None:
            return _Move(spec.req_id, *self._upload(rows, slots), loaded)
        # Blocks inside [start, end) move whole (from their sub-pages, ``block_view``), the
        # rest by row.
        block = self.runtime.shape.block_size
        first, stop = -(-spec.start // block), spec.end // block
        whole = (tokens >= first * block) & (tokens < stop * block)
        starts = torch.arange(first, stop) * block
        held = pages[(starts - loaded.start_tokens) // page]
        block_pages = held * (page // block) + starts % page // block
        page_ids, block_ids = block_pages.numpy(), np.asarray(spec.block_ids[first:stop])
        move = _Move(spec.req_id, *self._upload(rows[~whole], slots[~whole]), loaded)
        if len(page_ids):
            move.plan = self.blocks.plan("load", page_ids, block_ids)
            move.ids = self.blocks.ids(move.plan, self.blocks.device)
        return move

    def _upload(self, rows: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row indices on the pool's device, uploaded once for every layer: indexing a CUDA
        tensor with a CPU index uploads it and waits on the host each time, which would stall
        the forward's launches behind each layer's copy (a few host waits per layer)."""
        device = self.runtime.cache.device_pool.kv.device
        if device.type != "cuda":
            return rows, slots
        return rows.to(device, non_blocking=True), slots.to(device, non_blocking=True)

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
            kv = self.kv_caches[layer_name]
            if move.handle.ticket is not None:  # this layer's host -> pool copy may be in flight
                move.handle.ticket.stream_wait(layer=layer)
            if self.blocks is not None and move.plan is not None:
                self.blocks.copy(move.plan, layer, kv, move.ids)
            if len(move.rows):
                keys = pool[layer, 0].flatten(0, 1)[move.rows]
                values = pool[layer, 1].flatten(0, 1)[move.rows]
                self.layout.write(kv, move.slots, keys, values)
            move.layers.add(layer)
            self.runtime.counts["load_layer_copies"] += 1

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- saves -----------------------------------------------------------------------------
    def save_kv_layer(self, meta: KvtierConnectorMetadata, layer_name: str,
                      kv_layer: torch.Tensor) -> None:
        """Nothing: a save's rows are copied once the whole forward is queued (``wait_for_save``),
        not between its layers, where planning it would leave the GPU waiting on the CPU."""

    def wait_for_save(self, meta: KvtierConnectorMetadata) -> None:
        """Release the step's loads (or hand them to the request's save) and store its saves
        (see the module docstring); never waits for the device."""
        if self.steps is not None:
            self.steps.saves(meta)
            return
        loads = {move.req_id: move.handle for move in self._loads}
        self._check_loads_copied()
        self._loads = []
        if self.copy_in_step:
            self._save_in_step(meta)
            self._copied.update(meta.held if meta is not None else ())
        else:
            saver = self.runtime.saver
            for spec in meta.saves if meta is not None else ():
                handle = loads.pop(spec.req_id, None)
                handles = [handle] if handle is not None else []
                if not saver.submit(spec.req_id, spec=spec, handles=handles):
                    self.copier.release(handles)
        self._landing.extend(loads.values())
        self._release_landed()

    def _save_in_step(self, meta: KvtierConnectorMetadata | None) -> None:
        """Plan, copy (every layer, on the forward's stream) and commit the step's saves. A
        fault is counted and logged, never raised into vLLM's step, and the save's pages the
        cache did not take go back."""
        copier = self.copier
        assert copier is not None, "wait_for_save before register_kv_caches"
        for spec in meta.saves if meta is not None else ():
            save = None
            try:
                save = copier.plan(spec)
                if save is not None:
                    copier.copy_all(save)
            except Exception:
                self._save_failed(spec.req_id)
                if save is not None:
                    copier.abandon(save)
                continue
            if save is not None:
                try:
                    copier.commit(save)
                except Exception:
                    self._save_failed(spec.req_id)
                    copier.abandon(save)    # frees only the pages the cache did not take

    def _save_failed(self, req_id: str) -> None:
        self.runtime.counts["saves_failed"] += 1
        log.exception("kvtier connector: storing request %s failed; it stays uncached", req_id)

    def _check_loads_copied(self) -> None:
        """A forward that ran while some layer of a load was never copied read whatever vLLM's
        blocks held there: count it and say so (the scheduler's ``whole_loads`` mark and the
        per-layer hooks are meant to leave none)."""
        layers = len(self._layer_index)
        missed = sum(layers - len(move.layers) for move in self._loads)
        if missed:
            self.runtime.counts["load_layers_missed"] += missed
            log.error("kvtier connector: a forward ran before %d layer(s) of its loads were "
                      "copied (no per-layer hook ran and the step was not marked whole); "
                      "those hits read stale KV", missed)

    def load_all_layers(self) -> None:
        """Copy every layer of the step's loads now, before the forward: a full CUDA graph
        replays the forward without calling ``wait_for_layer_load``."""
        if self._loads:
            self.runtime.counts["load_steps_whole"] += 1
        for name in self.runtime.shape.layer_names:
            self.wait_for_layer_load(name)

    def _release_landed(self) -> None:
        """Release finished loads whose copy has landed; keep the others for a later step."""
        if not self._landing:
            return
        done: list[Any] = []
        waiting: list[Any] = []
        for handle in self._landing:
            landed = handle.ticket is None or handle.ticket.is_done()
            (done if landed else waiting).append(handle)
        self._landing = waiting
        if done:
            self.copier.release(done)

    def handle_preemptions(self, meta: KvtierConnectorMetadata) -> None:
        """vLLM frees preempted requests' blocks before this step's forward: stop reading them."""
        if not meta.preempted:
            return
        if self.steps is not None:
            self.steps.preempted(meta.preempted)
        else:
            self.runtime.saver.cancel(meta.preempted)

    def get_finished(self, finished_req_ids: set[str]) -> set[str] | None:
        """Finished requests whose blocks vLLM kept for a save and may now free: those this
        step's saves copied (stream-ordered before any later write to them), and on the saver's
        path those whose save has stopped reading them."""
        done, self._copied = self._copied, set()
        if self.steps is not None:
            done = self.steps.released()
        elif not self.copy_in_step:
            self._finished.update(finished_req_ids)
            done = self.runtime.saver.take_released(self._finished)
            self._finished -= done
        return done or None
