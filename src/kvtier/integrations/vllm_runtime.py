"""The one ``TieredCache`` an engine's two connector halves share, and what it is built from.

Owns ``ModelShape`` (what vLLM's KV cache config says about the model, checked: one group of
full-attention layers is served; other attention KV is refused hits and stores with a logged
reason, ``ModelShape.refused``), ``ConnectorRuntime`` (the cache, its lock, the hits
staged for requests waiting to be scheduled, counters) and ``runtime_for()``, a per-process
registry keyed by vLLM's engine id. vLLM builds the scheduler half and the worker half of a
connector separately; with one worker (``distributed_executor_backend="uni"``, vLLM's choice
for a single rank) both live in the engine-core process, so they find the same runtime here.
Several ranks would each need their own view of the host tier, which this runtime does not
give: they are refused at start naming the setting.

Every method takes the lock: vLLM calls the scheduler half from its scheduling loop and the
worker half from the model runner, which may be another thread under async scheduling, and the
runtime's ``Saver`` (``vllm_saver``) commits stored prompts from its own background thread. The
cache is built on that thread, so the IO threads it starts inherit its idle CPU priority.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError
from kvtier.integrations.vllm_events import EventLog
from kvtier.integrations.vllm_options import VllmConnectorOptions
from kvtier.integrations.vllm_saver import Saver
from kvtier.keys import KeyNamespace
from kvtier.layout import KVLayout

log = logging.getLogger(__name__)

#: Seconds the exit hook waits for queued store writes before closing the stores.
EXIT_DRAIN_S = 10.0


@dataclass(frozen=True)
class ModelShape:
    """The attention KV of the served model as vLLM's KV cache config lays it out."""

    model: str
    layer_names: tuple[str, ...]
    kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    #: Why kvtier neither serves nor stores this model's KV ("": it does); see ``model_shape``.
    refused: str = ""

    def layout(self, page_size: int) -> KVLayout:
        return KVLayout(len(self.layer_names), self.kv_heads, self.head_dim, self.dtype, page_size)


def model_shape(vllm_config: Any, kv_cache_config: Any) -> ModelShape:
    """Read and check the model's KV geometry.

    kvtier restores a hit exactly when every layer keeps every token's KV in its blocks: one
    group of full-attention layers. That includes a hybrid model's sliding-window layers once
    vLLM runs them with full-attention blocks (``FullAttentionSpec`` with ``sliding_window``
    set: what vLLM does for a connector without ``SupportsHMA``, kvtier's case, and on the CPU
    always), since attention only reads the window out of them. Other attention KV (a group
    that keeps only the window's blocks, chunked local attention, MLA, several groups) is
    served as without kvtier: ``refused`` says why, and the connector then claims no hit and
    stores nothing (a hit it cannot restore exactly would give wrong tokens). KV that is not
    attention KV at all, and several ranks, are refused at start."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    parallel = vllm_config.parallel_config
    if parallel.world_size != 1:
        raise ConfigError("tensor_parallel_size x pipeline_parallel_size", parallel.world_size,
                          "1 (kvtier's vLLM connector serves a single-rank engine)")
    groups = [g for g in kv_cache_config.kv_cache_groups if g.enable_kv_transfer]
    specs = [g.kv_cache_spec for g in groups]
    if not specs or not all(isinstance(s, AttentionSpec) for s in specs):
        raise ConfigError("model KV cache groups", _kinds(specs), "attention KV cache groups "
                          "(kvtier stores attention KV only)")
    spec = specs[0]
    if spec.head_size_v != spec.head_size:
        raise ConfigError("head_size_v", spec.head_size_v, f"equal to head_size {spec.head_size}")
    return ModelShape(model=str(vllm_config.model_config.model),
                      layer_names=tuple(groups[0].layer_names), kv_heads=spec.num_kv_heads,
                      head_dim=spec.head_size, dtype=str(spec.dtype).removeprefix("torch."),
                      block_size=spec.block_size, refused=_why_not_restorable(specs))


def _why_not_restorable(specs: list[Any]) -> str:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    if len(specs) != 1:
        return f"{len(specs)} KV cache groups {_kinds(specs)} (kvtier stores one)"
    spec = specs[0]
    if type(spec) is not FullAttentionSpec or isinstance(spec, MLAAttentionSpec):
        return (f"KV cache group {_kinds(specs)}: its layers do not keep every token's KV "
                "in full-attention blocks")
    if spec.attention_chunk_size:
        return f"chunked local attention (chunk {spec.attention_chunk_size}), not verified"
    return ""


def _kinds(specs: list[Any]) -> list[str]:
    return [type(s).__name__ + (f"(window={s.sliding_window})"
                                if getattr(s, "sliding_window", None) else "") for s in specs]


def model_fingerprint(vllm_config: Any, given: str) -> str:
    """The user's fingerprint, else a digest of the model's config and revision."""
    if given:
        return given
    model_config = vllm_config.model_config
    text = model_config.hf_config.to_json_string() + str(model_config.revision)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class ConnectorRuntime:
    """The shared cache and the per-request state both halves of the connector read."""

    def __init__(self, options: VllmConnectorOptions, shape: ModelShape, cache: Any,
                 namespace: KeyNamespace, saver: Saver) -> None:
        self.options = options
        self.shape = shape
        self.cache = cache
        self.saver = saver
        self.namespace = namespace
        self.lock = threading.RLock()
        self.staged: dict[str, Any] = {}      # request id -> kvtier Loaded, until its load ran
        self.counts: Counter[str] = Counter()
        self.events = EventLog()
        self._closed = False

    @property
    def page_size(self) -> int:
        return self.cache.page_size

    def take_staged(self, req_id: str) -> Any:
        with self.lock:
            return self.staged.pop(req_id, None)

    def release_staged(self, req_id: str) -> None:
        if req_id not in self.staged:       # the common case (a miss) takes no lock
            return
        with self.lock:
            loaded = self.staged.pop(req_id, None)
            if loaded is not None:
                self.cache.release(loaded)

    def stats(self) -> dict[str, Any]:
        with self.lock:
            counts = self.counts + self.saver.counts
            return {"connector": dict(counts), "cache": self.cache.stats()}

    def drain(self, timeout_s: float) -> bool:
        """Wait until queued saves are committed and the cache's copies and IO are done."""
        deadline = time.monotonic() + timeout_s
        if not self.saver.drain(timeout_s):
            return False
        with self.lock:
            return bool(self.cache.drain(max(0.0, deadline - time.monotonic())))

    def close(self, timeout_s: float = EXIT_DRAIN_S) -> None:
        """Let queued writes reach the stores, then close them (idempotent)."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
        if not self.saver.drain(timeout_s):
            log.warning("kvtier: prompt saves still queued after %.1f s at close", timeout_s)
        self.saver.close(1.0)
        with self.lock:
            for loaded in self.staged.values():
                self.cache.release(loaded)
            self.staged.clear()
            if not self.cache.drain(timeout_s):
                log.warning("kvtier: store writes still in flight after %.1f s at close", timeout_s)
            self.cache.close()


_RUNTIMES: dict[str, ConnectorRuntime] = {}
_REGISTRY_LOCK = threading.Lock()


def runtime_for(vllm_config: Any, kv_cache_config: Any,
                options: VllmConnectorOptions) -> ConnectorRuntime:
    """The engine's runtime, built by whichever connector half asks first."""
    engine_id = str(vllm_config.kv_transfer_config.engine_id)
    with _REGISTRY_LOCK:
        runtime = _RUNTIMES.get(engine_id)
        if runtime is None or runtime._closed:
            runtime = _build(vllm_config, kv_cache_config, options)
            _RUNTIMES[engine_id] = runtime
        return runtime


def _build(vllm_config: Any, kv_cache_config: Any,
           options: VllmConnectorOptions) -> ConnectorRuntime:
    backend = vllm_config.parallel_config.distributed_executor_backend
    if backend not in (None, "uni"):
        raise ConfigError("distributed_executor_backend", backend, "uni: a single worker in the "
                          "engine-core process (on vLLM's CPU backend, which otherwise starts "
                          "its worker as a process of its own, set "
                          "VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    shape = model_shape(vllm_config, kv_cache_config)
    page_size = options.config.cache.page_size
    layout = shape.layout(page_size)
    namespace = KeyNamespace(shape.model, model_fingerprint(vllm_config, options.model_fingerprint),
                             shape.dtype, layout.fingerprint(), page_size)
    device = _device(vllm_config)
    saver = Saver(options.save_queue_depth, options.background_priority)
    try:
        cache = saver.call(lambda: _build_cache_here(options, layout, namespace, device))
    except BaseException:
        saver.close(1.0)
        raise
    runtime = ConnectorRuntime(options, shape, cache, namespace, saver)
    atexit.register(runtime.close)
    if shape.refused:
        log.warning("kvtier connector: this model's KV is not served from or stored into "
                    "kvtier (%s); vLLM computes every prompt as without kvtier (counted "
                    "requests_refused_model_kv)", shape.refused)
    log.info("kvtier connector: %d layers x %d heads x %d, %s, page %d tokens (vLLM block %d), "
             "stores %s", len(shape.layer_names), shape.kv_heads, shape.head_dim, shape.dtype,
             page_size, shape.block_size, [t for t, u in (("disk", options.store.disk_url),
                                                    ("remote", options.store.remote_url)) if u])
    return runtime


def _device(vllm_config: Any) -> str:
    """The device vLLM runs on, with its index (the cache is built on another thread)."""
    if vllm_config.device_config.device_type != "cuda":
        return "cpu"
    import torch

    return f"cuda:{torch.cuda.current_device()}"


def _build_cache_here(options: VllmConnectorOptions, layout: KVLayout, namespace: KeyNamespace,
                      device: str) -> Any:
    from kvtier.cache import TieredCache

    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(device))
    return TieredCache.build(options.config, layout, namespace, device=device)


def runtimes() -> list[ConnectorRuntime]:
    """The open runtimes of this process (tests and benchmarks read their counters)."""
    with _REGISTRY_LOCK:
        return [r for r in _RUNTIMES.values() if not r._closed]
