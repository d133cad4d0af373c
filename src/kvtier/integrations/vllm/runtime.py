"""The one ``TieredCache`` an engine's connector halves share, and what it is built from.

Owns ``ModelShape`` (what vLLM's KV cache config says about the model, checked: one group of
full-attention layers is served; other attention KV is refused hits and stores with a logged
reason, ``ModelShape.refused``), ``ConnectorRuntime`` (the cache, its lock, the hits
staged for requests waiting to be scheduled, counters), ``RankRuntime`` (what a worker in a
process of its own holds) and ``runtime_for()``, a per-process registry keyed by vLLM's engine
id. vLLM builds the scheduler half and the worker half of a connector separately:

- with one worker in the engine-core process (``distributed_executor_backend="uni"``, vLLM's
  choice for a single GPU) both find the same runtime here, and the worker copies straight
  from the cache's device pool (on CUDA overlapping the forward);
- with workers in processes of their own (``"mp"``: tensor parallelism, or vLLM's CPU backend
  with multiprocessing on) the engine-core process holds the cache, whose staging pool lives in
  shared memory (``shared_pool``), and each worker holds a ``RankRuntime`` and copies its
  KV heads' slice of the staged pages (``rank_worker``). Pages keep every head of the model in
  kvtier's canonical order in both cases, so any TP size reads what any other wrote.

Pipeline and decode-context parallelism, Ray and multi-node executors are refused at start
naming the setting.

Every method takes the lock: vLLM calls the scheduler half from its scheduling loop and the
worker half from the model runner, which may be another thread under async scheduling, and the
runtime's ``Saver`` (``saver``) commits stored prompts from its own background thread. The
cache is built on that thread, so the IO threads it starts inherit its idle CPU priority.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.compat import full_graph_max_tokens, transfer_groups
from kvtier.integrations.vllm.events import ConnectorEvents
from kvtier.integrations.vllm.fingerprint import model_fingerprint
from kvtier.integrations.vllm.options import (
    DEFAULT_STAGING_PAGES,
    VllmConnectorOptions,
    resolve_direct,
    with_direct,
    with_staging_pages,
)
from kvtier.integrations.vllm.saver import Saver
from kvtier.integrations.vllm.shared_pool import SharedPool
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
    kv_heads: int                  # the model's KV heads (a kvtier page holds all of them)
    head_dim: int
    dtype: str
    block_size: int
    #: Why kvtier neither serves nor stores this model's KV ("": it does); see ``model_shape``.
    refused: str = ""
    #: KV heads in one rank's KV tensors (``kv_heads`` unless tensor parallel) and the TP size.
    rank_kv_heads: int = 0
    tp_size: int = 1
    #: Steps of at most this many tokens may replay a full CUDA graph (no per-layer hooks run
    #: in it); 0: the engine never replays one (``compat.full_graph_max_tokens``).
    full_graph_tokens: int = 0

    def rank_heads(self, rank: int) -> tuple[int, int]:
        """The model's KV heads ``[first, end)`` that TP rank ``rank`` keeps (vLLM's split:
        consecutive equal shares, or each head replicated on ``tp_size // kv_heads`` ranks)."""
        local = self.rank_kv_heads or self.kv_heads
        if self.tp_size <= self.kv_heads:
            return rank * local, (rank + 1) * local
        first = rank // (self.tp_size // self.kv_heads)
        return first, first + local

    def writes_heads(self, rank: int) -> bool:
        """Whether ``rank`` writes its heads into a save: the first of the ranks holding them."""
        return self.tp_size <= self.kv_heads or rank % (self.tp_size // self.kv_heads) == 0

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
    if parallel.pipeline_parallel_size != 1:
        raise ConfigError("pipeline_parallel_size", parallel.pipeline_parallel_size,
                          "1 (kvtier's vLLM connector serves tensor parallelism only)")
    if getattr(parallel, "decode_context_parallel_size", 1) != 1:
        raise ConfigError("decode_context_parallel_size", parallel.decode_context_parallel_size,
                          "1 (kvtier pages hold every token of a page on one rank)")
    groups = transfer_groups(kv_cache_config)
    specs = [g.kv_cache_spec for g in groups]
    if not specs or not all(isinstance(s, AttentionSpec) for s in specs):
        raise ConfigError("model KV cache groups", _kinds(specs), "attention KV cache groups "
                          "(kvtier stores attention KV only)")
    spec = specs[0]
    if spec.head_size_v != spec.head_size:
        raise ConfigError("head_size_v", spec.head_size_v, f"equal to head_size {spec.head_size}")
    tp_size = parallel.tensor_parallel_size
    total_heads = vllm_config.model_config.get_total_num_kv_heads()
    if spec.num_kv_heads != max(1, total_heads // tp_size):
        raise ConfigError("KV heads per rank", spec.num_kv_heads,
                          f"{max(1, total_heads // tp_size)} ({total_heads} heads over "
                          f"tensor_parallel_size {tp_size})")
    return ModelShape(model=str(vllm_config.model_config.model),
                      layer_names=tuple(groups[0].layer_names), kv_heads=total_heads,
                      head_dim=spec.head_size, dtype=str(spec.dtype).removeprefix("torch."),
                      block_size=spec.block_size, refused=_why_not_restorable(specs),
                      rank_kv_heads=spec.num_kv_heads, tp_size=tp_size,
                      full_graph_tokens=full_graph_max_tokens(vllm_config))


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


class ConnectorRuntime:
    """The shared cache and the per-request state both halves of the connector read."""

    def __init__(self, options: VllmConnectorOptions, shape: ModelShape, cache: Any,
                 namespace: KeyNamespace, saver: Saver, shared: SharedPool | None = None,
                 on_cuda: bool = False) -> None:
        self.options = options
        self.shape = shape
        self.cache = cache
        self.saver = saver
        self.namespace = namespace
        #: The staging pool in shared memory when the workers run in processes of their own.
        self.shared = shared
        #: The workers copy every save inside the step that carries it (stream-ordered on
        #: CUDA; a rank's copies end in its step): no save waits on the saver thread to read
        #: vLLM's blocks. False on vLLM's CPU backend in one process (the saver copies there).
        #: Loads and saves go between vLLM's blocks and host pages (``direct``, decided by
        #: ``resolve_direct`` before this runtime is built; unset counts as off): no staging.
        self.direct = bool(options.direct)
        self.saves_in_step = on_cuda or shared is not None or self.direct
        self.lock = threading.RLock()
        self.staged: dict[str, Any] = {}      # request id -> kvtier Loaded, until its load ran
        self.counts: Counter[str] = Counter()
        self.events = ConnectorEvents(cache.index, shape.block_size)
        self._closed = False

    @property
    def page_size(self) -> int:
        return self.cache.page_size

    @property
    def ranked(self) -> bool:
        """The workers run in processes of their own (``rank_worker``)."""
        return self.shared is not None

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
        if self.shared is not None:
            self.shared.close()


class RankRuntime:
    """What a worker in a process of its own holds: the model's shape, the options, counters.
    The cache, its stores and the staging pool's owner are in the engine-core process."""

    def __init__(self, options: VllmConnectorOptions, shape: ModelShape) -> None:
        self.options = options
        self.shape = shape
        self.page_size = options.config.cache.page_size
        self.counts: Counter[str] = Counter()

    def stats(self) -> dict[str, Any]:
        return {"connector": dict(self.counts)}

    def close(self) -> None:
        """Nothing to close: the pool's mapping goes with the worker's tensors."""


_RUNTIMES: dict[str, ConnectorRuntime] = {}
_REGISTRY_LOCK = threading.Lock()


def workers_in_own_processes(vllm_config: Any) -> bool:
    """Whether vLLM runs its workers in processes of their own (``"mp"``), which kvtier serves
    through a shared staging pool; refuses executors it cannot share memory with."""
    parallel = vllm_config.parallel_config
    backend = parallel.distributed_executor_backend
    if backend in (None, "uni") and parallel.world_size == 1:
        return False
    if backend != "mp":
        raise ConfigError("distributed_executor_backend", backend,
                          "uni or mp (kvtier's workers share its staging pool through this "
                          "host's shared memory)")
    if getattr(parallel, "nnodes", 1) != 1:
        raise ConfigError("nnodes", parallel.nnodes, "1 (workers on other hosts cannot map "
                          "kvtier's shared staging pool)")
    return True


def runtime_for(vllm_config: Any, kv_cache_config: Any, options: VllmConnectorOptions,
                scheduler: bool = True) -> ConnectorRuntime | RankRuntime:
    """The engine's runtime, built by whichever connector half asks first; a worker in a
    process of its own (``scheduler`` False there) gets a ``RankRuntime`` of its own."""
    ranked = workers_in_own_processes(vllm_config)
    if ranked and not scheduler:
        return RankRuntime(options, model_shape(vllm_config, kv_cache_config))
    engine_id = str(vllm_config.kv_transfer_config.engine_id)
    with _REGISTRY_LOCK:
        runtime = _RUNTIMES.get(engine_id)
        if runtime is None or runtime._closed:
            runtime = _build(vllm_config, kv_cache_config, options, ranked)
            _RUNTIMES[engine_id] = runtime
        return runtime


def _build(vllm_config: Any, kv_cache_config: Any, options: VllmConnectorOptions,
           ranked: bool) -> ConnectorRuntime:
    shape = model_shape(vllm_config, kv_cache_config)
    page_size = options.config.cache.page_size
    layout = shape.layout(page_size)
    namespace = KeyNamespace(shape.model, model_fingerprint(vllm_config, options.model_fingerprint),
                             shape.dtype, layout.fingerprint(), page_size)
    if ranked and options.direct:
        raise ConfigError("kv_connector_extra_config.direct", True, "false with workers in "
                          "processes of their own (tensor parallelism): they share staging "
                          "pages, not kvtier's host tier")
    device = "cpu" if ranked else _device(vllm_config)
    options = with_direct(options, resolve_direct(options, device, ranked, shape.block_size))
    if options.staging_from_default and device.startswith("cuda"):
        options = with_staging_pages(options, default_staging_pages(
            vllm_config.model_config.max_model_len, layout, _free_gpu_bytes(device)))
    shared = _shared_pool(vllm_config, options, layout) if ranked else None
    saver = Saver(options.save_queue_depth, options.background_priority)
    try:
        cache = saver.call(lambda: _build_cache_here(options, layout, namespace, device, shared))
    except BaseException:
        saver.close(1.0)
        if shared is not None:
            shared.close()
        raise
    runtime = ConnectorRuntime(options, shape, cache, namespace, saver, shared,
                               on_cuda=device.startswith("cuda"))
    atexit.register(runtime.close)
    if shape.refused:
        log.warning("kvtier connector: this model's KV is not served from or stored into "
                    "kvtier (%s); vLLM computes every prompt as without kvtier (counted "
                    "requests_refused_model_kv)", shape.refused)
    log.info("kvtier connector: %d layers x %d heads x %d, %s, page %d tokens (vLLM block %d), "
             "stores %s, %s", len(shape.layer_names), shape.kv_heads, shape.head_dim, shape.dtype,
             page_size, shape.block_size, [t for t, u in (("disk", options.store.disk_url),
                                                    ("remote", options.store.remote_url)) if u],
             f"{shape.tp_size} worker process(es) over a shared staging pool" if ranked
             else "worker in this process")
    if options.direct:
        log.info("kvtier connector: direct path: loads and saves move between vLLM's blocks "
                 "and kvtier's host tier (%.2f GiB), no staging pages on %s",
                 options.config.host.pool_bytes / 2**30, device)
        return runtime
    staging = options.config.cache.device_pages
    log.info("kvtier connector: staging pool of %d pages (%.2f GiB on %s): prompts up to %d "
             "tokens are saved whole, longer ones are not stored (counted "
             "saves_refused_no_staging); the staging_pages key changes it", staging,
             staging * layout.page_bytes / 2**30, device, staging * page_size)
    return runtime


def default_staging_pages(max_model_len: int, layout: KVLayout, free_gpu_bytes: int) -> int:
    """Staging pages when none are configured: two prompts of ``max_model_len`` (one loading
    while another is saved), at most half the GPU memory free now (vLLM has taken its share
    when the connector starts), never under ``DEFAULT_STAGING_PAGES``."""
    wanted = 2 * -(-max(1, int(max_model_len)) // layout.page_size)
    room = free_gpu_bytes // 2 // layout.page_bytes
    return max(DEFAULT_STAGING_PAGES, min(wanted, room))


def _free_gpu_bytes(device: str) -> int:
    import torch

    return int(torch.cuda.mem_get_info(torch.device(device))[0])


def _shared_pool(vllm_config: Any, options: VllmConnectorOptions, layout: KVLayout) -> SharedPool:
    from kvtier.memory.device_pool import cpu_pool_pages, torch_dtype

    pages = cpu_pool_pages(options.config.cache, layout)
    shape = (layout.num_layers, layout.parts, pages, *layout.part_shape())
    tag = f"{vllm_config.kv_transfer_config.engine_id}-dp{vllm_config.parallel_config.data_parallel_rank}"
    return SharedPool(tag, shape, torch_dtype(layout.dtype))


def _device(vllm_config: Any) -> str:
    """The device vLLM runs on, with its index (the cache is built on another thread)."""
    if vllm_config.device_config.device_type != "cuda":
        return "cpu"
    import torch

    return f"cuda:{torch.cuda.current_device()}"


def _build_cache_here(options: VllmConnectorOptions, layout: KVLayout, namespace: KeyNamespace,
                      device: str, shared: SharedPool | None = None) -> Any:
    from kvtier.cache import TieredCache
    from kvtier.memory.device_pool import DevicePool

    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(device))
    # With workers in processes of their own the host tier only feeds the shared pool by
    # memcpy: pinning it would bring CUDA into the engine-core process for nothing.
    pool = DevicePool.over(layout, shared.tensor) if shared is not None else None
    return TieredCache.build(options.config, layout, namespace, device=device, device_pool=pool,
                             pin_host=False if shared is not None else None)


def runtimes() -> list[ConnectorRuntime]:
    """The open runtimes of this process (tests and benchmarks read their counters)."""
    with _REGISTRY_LOCK:
        return [r for r in _RUNTIMES.values() if not r._closed]
