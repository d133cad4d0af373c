"""kvtier as a vLLM KV connector (vLLM 0.26 to 0.33): ``KvtierConnector`` (``KVConnectorBase_V1``).

Load it with (see README, "vLLM")::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvtierConnector",
      "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
      "kv_connector_extra_config": {"disk_url": "file:///nvme/kvtier"}}'

vLLM builds one instance per role with ``(vllm_config, role, kv_cache_config)``. Both share one
``ConnectorRuntime`` (``runtime``: the ``TieredCache``, checks of the model and the
parallel setup, refusals at start); the scheduler role delegates to ``SchedulerSide``
(``scheduler``), the worker role to ``WorkerSide`` (``worker``), or, for a worker
in a process of its own (a TP rank), to ``RankWorker`` (``rank_worker``). Options:
``options``; KV tensor layouts: ``layout``; events: ``events``. Each method runs
on the thread vLLM calls it from (scheduling loop or model runner).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvtier.integrations.vllm import compat
from kvtier.integrations.vllm.options import parse_connector_config
from kvtier.integrations.vllm.rank_worker import RankWorker
from kvtier.integrations.vllm.runtime import RankRuntime, runtime_for
from kvtier.integrations.vllm.scheduler import KvtierConnectorMetadata, SchedulerSide
from kvtier.integrations.vllm.stats import CounterReport, KvtierConnectorStats, KvtierPromMetrics
from kvtier.integrations.vllm.worker import WorkerSide

__all__ = ["KvtierConnector", "KvtierConnectorMetadata"]


class KvtierConnector(KVConnectorBase_V1):
    """kvtier's tiers (host, disk, Redis) behind vLLM's paged KV cache."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        compat.check_version()
        block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        options = parse_connector_config(
            self._kv_transfer_config.kv_connector_extra_config, block_size)
        scheduler = role == KVConnectorRole.SCHEDULER
        self.runtime: Any = runtime_for(vllm_config, kv_cache_config, options, scheduler)
        self.scheduler = SchedulerSide(self.runtime) if scheduler else None
        self.worker: Any = None
        self._saved_step: KvtierConnectorMetadata | None = None   # the last step's saves ran
        if role == KVConnectorRole.WORKER and isinstance(self.runtime, RankRuntime):
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.worker = RankWorker(self.runtime, get_tensor_model_parallel_rank())
        elif role == KVConnectorRole.WORKER:
            self.worker = WorkerSide(self.runtime, copy_in_step=self.runtime.saves_in_step)
        #: The scheduler half reports the engine's counters; a worker in a process of its own
        #: its own; a worker sharing the scheduler's runtime nothing (they would count twice).
        reports = scheduler or isinstance(self.runtime, RankRuntime)
        self._report = CounterReport(self.runtime) if reports else None

    # ---- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        backend, write_op = _attention_backend(self._vllm_config, self._kv_cache_config,
                                               self.runtime, kv_caches)
        self.worker.register_kv_caches(kv_caches, backend, write_op)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if isinstance(self.worker, RankWorker):
            return self.worker.build_worker_meta()
        return None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        started = time.perf_counter()
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        self.worker.start_load_kv(meta)
        # A full CUDA graph replays the forward without calling the per-layer hooks: copy the
        # loads whole now. The scheduler marks every step small enough to be one (the mark
        # does not depend on reading the forward context right); the context says it too.
        if meta.whole_loads or compat.graph_hides_layers(forward_context):
            self.worker.load_all_layers()
        self._time_hook(started)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self.worker.save_kv_layer(self._get_connector_metadata(), layer_name, kv_layer)

    def wait_for_save(self) -> None:
        """Store the step's saves, once per step: vLLM calls this after the forward, and
        ``get_finished`` calls it when vLLM did not (a step without a forward on vLLM 0.26;
        a deferred finalize, where vLLM asks ``get_finished`` first)."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        if meta is self._saved_step:
            return
        self._saved_step = meta
        started = time.perf_counter()
        self.worker.wait_for_save(meta)
        self._time_hook(started)

    def _time_hook(self, started: float) -> None:
        """Count the model runner's time in a step hook (``worker_hooks_us``): the connector's
        CPU cost per step, beside the scheduler's ``meta_build_us``."""
        self.runtime.counts["worker_hooks_us"] += int((time.perf_counter() - started) * 1e6)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KvtierConnectorMetadata)
        if isinstance(self.worker, WorkerSide):   # a rank's copies end inside their step
            self.worker.handle_preemptions(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # The blocks reported free must have been copied first: a finished request's save
        # rides in this step, which may have had no ``wait_for_save`` yet.
        self.wait_for_save()
        sending = self.worker.get_finished(finished_req_ids)
        if isinstance(self.worker, WorkerSide):      # the direct path's loads are asynchronous
            return sending, self.worker.take_received()
        return sending, None                         # loads finish inside the step

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self.scheduler is not None and self.scheduler.ranked is not None:
            self.scheduler.ranked.close()
        self.runtime.close()

    # ---- scheduler side --------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict:
        return self.scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self.scheduler.request_finished(request, block_ids)

    def take_events(self) -> Iterable[Any]:
        return self.runtime.events.take()

    # ---- vLLM's metrics --------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KvtierConnectorStats | None:
        moved = self._report.take() if self._report is not None else None
        return KvtierConnectorStats(data=moved) if moved else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierConnectorStats:
        return KvtierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[Any, Any],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _attention_backend(vllm_config: Any, kv_cache_config: Any, runtime: Any,
                       kv_caches: dict[str, torch.Tensor]) -> tuple[str, Any]:
    """The attention backend's name, checked: the registered tensors have the shape vLLM's own
    code allocates for it (``compat.expected_kv_shape``); on the CPU also vLLM's cache-write op
    (to prove the layout inside a block)."""
    from kvtier.errors import ConfigError, KvtierError

    first_name = runtime.shape.layer_names[0]
    layer = vllm_config.compilation_config.static_forward_context.get(first_name)
    if layer is None or not hasattr(layer, "attn_backend"):
        raise KvtierError(f"vLLM has no attention layer {first_name!r} "
                          "to read the attention backend from")
    backend = layer.attn_backend.get_name()
    first = kv_caches.get(first_name)
    if first is not None:
        spec = compat.transfer_groups(kv_cache_config)[0].kv_cache_spec
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        expected = compat.expected_kv_shape(layer.attn_backend, spec, first.shape[0], cache_dtype)
        if tuple(first.shape) != expected:
            raise ConfigError("KV cache tensor", f"{backend} {list(first.shape)}",
                              f"{list(expected)}, the shape vLLM allocates for this backend")
    if not backend.upper().startswith("CPU"):
        return backend, None
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    shape = runtime.shape
    isa = _get_attn_isa(getattr(torch, shape.dtype), shape.block_size, shape.head_dim)

    def write(keys, values, key_cache, value_cache, slots):
        ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    return backend, write
