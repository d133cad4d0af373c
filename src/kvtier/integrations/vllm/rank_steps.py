"""The scheduler's bookkeeping of steps run by workers in processes of their own.

Owns ``RankedSteps`` and ``KvtierWorkerMeta``. With vLLM's workers in their own processes
(``runtime.workers_in_own_processes``: tensor parallelism, or the CPU backend with
multiprocessing on) kvtier's cache stays in the engine-core process and its staging pool lives
in shared memory (``shared_pool``). Each step's metadata then names the pool pages
itself, since a worker cannot look up what the scheduler staged:

- a load's ``LoadSpec.pages`` are the staged, verified pages of its hit; they stay pinned until
  every rank has said it ran the step;
- a save is planned here (``SaveCopier.plan``: staging pages, pages kvtier holds reused) and
  its ``SaveSpec.pages`` tell each rank where to put its heads; it is committed (on the saver
  thread, ``saver``) once every rank has said it copied them;
- a finished request whose output filled more pages keeps its blocks until the step that
  copies them (``SchedulerSide`` puts its save and its ``held`` mark in that step's
  metadata): each rank reports it done in that step, and vLLM frees the blocks once all have.

Each rank reports the steps it ran whole in its ``KvtierWorkerMeta``; vLLM sums them over the
ranks (``aggregate``) and hands the sum to ``update_connector_output``. Steps end in order, so
a step every rank ran ends every step before it too. A step a rank could not run (its copies
failed) abandons that step's saves; that rank reports the failed loads' blocks itself
(vLLM recomputes them). Runs on vLLM's scheduling thread; commits run on the saver thread.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from kvtier.integrations.vllm.runtime import ConnectorRuntime
from kvtier.integrations.vllm.saves import PromptSave, SaveCopier
from kvtier.integrations.vllm.specs import LoadSpec


@dataclass
class KvtierWorkerMeta(KVConnectorWorkerMetadata):
    """Per step number, how many ranks ran it whole (``done``) or could not (``failed``)."""

    done: dict[int, int] = field(default_factory=dict)
    failed: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KvtierWorkerMeta:
        assert isinstance(other, KvtierWorkerMeta)
        out = KvtierWorkerMeta(dict(self.done), dict(self.failed))
        for mine, theirs in ((out.done, other.done), (out.failed, other.failed)):
            for step, count in theirs.items():
                mine[step] = mine.get(step, 0) + count
        return out


@dataclass
class _Step:
    loads: list[Any] = field(default_factory=list)       # staged Loaded handles to release
    saves: list[PromptSave] = field(default_factory=list)


class RankedSteps:
    """See the module docstring."""

    def __init__(self, runtime: ConnectorRuntime) -> None:
        assert runtime.shared is not None
        self.runtime = runtime
        self.ranks = runtime.shape.tp_size
        self.copier = SaveCopier(runtime, None, None)
        runtime.saver.copier = self.copier       # commits planned saves on the saver thread
        self._next = 1
        self._pending: dict[int, _Step] = {}

    def prepare(self, meta: Any) -> None:
        """Number the step, name the pool, and put the staged pages into its loads and the
        planned pages into its saves (``meta.saves``: the prompts to store)."""
        rt, step = self.runtime, _Step()
        assert rt.shared is not None
        meta.step, meta.pool = self._next, rt.shared.ref
        self._next += 1
        by_request: dict[str, Any] = {}
        loads: list[LoadSpec] = list(meta.loads)
        meta.loads = []
        for spec in loads:
            loaded = rt.take_staged(spec.req_id)
            if loaded is None:              # released meanwhile: the worker reports the error
                meta.loads.append(spec)
                continue
            by_request[spec.req_id] = loaded
            meta.loads.append(dataclasses.replace(spec, pages=tuple(loaded.device_page_ids),
                                                  page_start=loaded.start_tokens))
        saves, meta.saves = list(meta.saves), []
        for spec in saves:
            handle = by_request.pop(spec.req_id, None)
            save = self.copier.plan(spec, [handle] if handle is not None else [])
            if save is None:
                continue
            held = len(save.page_ids) - len(save.fresh)
            meta.saves.append(dataclasses.replace(spec, pages=tuple(save.page_ids),
                                                  start=held * rt.page_size))
            step.saves.append(save)
        step.loads = list(by_request.values())
        if step.loads or step.saves:
            self._pending[meta.step] = step

    def on_output(self, worker_meta: Any) -> None:
        """End the steps every rank reported (and every step before them)."""
        if not isinstance(worker_meta, KvtierWorkerMeta) or not self._pending:
            return
        failed = {s for s, n in worker_meta.failed.items() if n}
        ran = [s for s, n in worker_meta.done.items() if n + worker_meta.failed.get(s, 0)
               >= self.ranks]
        if not ran:
            return
        last = max(ran)
        for step in sorted(s for s in self._pending if s <= last):
            self._end(self._pending.pop(step), ok=step not in failed)

    def _end(self, step: _Step, ok: bool) -> None:
        rt = self.runtime
        for save in step.saves:
            if not ok:
                rt.counts["saves_failed_on_a_rank"] += 1
                self.copier.abandon(save)
                continue
            save.layers_copied = self.copier.num_layers
            if not rt.saver.submit(save.req_id, save=save):
                self.copier.abandon(save)
        if step.loads:
            self.copier.release(step.loads)

    def close(self) -> None:
        """Give back what steps still pending hold (the engine is shutting down)."""
        for number in sorted(self._pending):
            step = self._pending.pop(number)
            for save in step.saves:
                self.copier.abandon(save)
            self.copier.release(step.loads)
