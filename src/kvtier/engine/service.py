"""The engine as a service: model + tiered cache + scheduler, built once from ``KvtierConfig``.

Owns ``EngineService``, what the HTTP server and the TTFT benchmark hold: it loads the model,
builds the ``TieredCache`` (unless ``cache.enabled`` is false, the ``--no-cache`` baseline),
starts the engine thread and accepts ``GenerationRequest``s from any thread. No web framework
imports. Built on the main thread; ``submit`` is thread-safe.
"""

from __future__ import annotations

import logging
from typing import Any

from kvtier.config import KvtierConfig
from kvtier.engine.ahead import Lookahead
from kvtier.engine.hf import CausalLM, load_model
from kvtier.engine.request import GenerationRequest, RequestHandle
from kvtier.engine.runner import Engine
from kvtier.engine.scheduler import Scheduler
from kvtier.errors import ConfigError

log = logging.getLogger("kvtier.engine")


class EngineService:
    """A running engine; ``close()`` stops the thread and the cache."""

    def __init__(self, config: KvtierConfig, lm: CausalLM, prefix_cache: Any = None, *,
                 max_running: int | None = None) -> None:
        self.config = config
        self.lm = lm
        self.prefix_cache = prefix_cache
        pages = _page_source(config, lm, prefix_cache)
        graphs = _decode_graphs(config, lm, pages)
        self.engine = Engine(lm, pages, chunk_tokens=config.engine.prefill_chunk_tokens,
                             prefix_cache=prefix_cache, decode_graphs=graphs,
                             suffix=_suffix_step(config, lm, pages, prefix_cache),
                             lookahead=Lookahead(graphs)
                             if graphs is not None and config.engine.decode_ahead else None)
        try:
            self.kv_events = _kv_events(config, prefix_cache)
        except BaseException:
            if prefix_cache is not None:
                prefix_cache.close()
            raise
        poll = prefix_cache.poll if prefix_cache is not None else None
        self.scheduler = Scheduler(self.engine, max_running=max_running or config.engine.max_running,
                                   max_pending=config.server.max_concurrent_requests, poll=poll)
        self.scheduler.start()

    @classmethod
    def build(cls, config: KvtierConfig, *, max_running: int | None = None,
              lm: CausalLM | None = None, split: str | None = None) -> EngineService:
        """Load the model (unless given) and the cache the config asks for; ``split`` chooses
        how a hit is served (``plan``: the planner's load/recompute split; None:
        ``engine.store_hit_split``); ``max_running`` overrides ``engine.max_running``."""
        lm = lm or load_model(config.engine.model, device=config.engine.device,
                              dtype=config.engine.dtype, seed=config.engine.seed,
                              attention=config.engine.attention,
                              deterministic=config.engine.deterministic,
                              prefill_attention=config.engine.prefill_attention)
        prefix_cache = None
        if config.cache.enabled:
            from kvtier.engine.prefix import PrefixCache

            prefix_cache = PrefixCache.build(config, lm, split=split, graphs=False)
        from kvtier.engine import paged

        log.info("engine ready: model %s on %s (%s), cache %s, %s, prompt attention %s",
                 lm.name, lm.device, lm.dtype_name, "on" if prefix_cache else "off",
                 "deterministic kernels (hits bit-identical to a recompute)" if lm.deterministic
                 else "library kernels (engine.deterministic off: a hit's logits may differ "
                      "from a recompute's in the last bits)", paged.backend_of(lm))
        return cls(config, lm, prefix_cache, max_running=max_running)

    @property
    def model_name(self) -> str:
        return self.lm.name

    @property
    def tokenizer(self) -> Any:
        return self.lm.tokenizer

    @property
    def alive(self) -> bool:
        thread = self.scheduler._thread
        return thread is not None and thread.is_alive()

    def submit(self, request: GenerationRequest, sink: Any = None) -> RequestHandle:
        """Queue a request; raises ``QueueFull`` when the server is at its limit."""
        handle = RequestHandle(request)
        if sink is not None:
            handle.set_sink(sink)
        return self.scheduler.submit(handle)

    def generate(self, request: GenerationRequest, timeout: float | None = None) -> Any:
        """Submit and wait: (token ids, finish event)."""
        return self.submit(request).result(timeout)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.lm.name, "device": str(self.lm.device),
                               "dtype": self.lm.dtype_name, "scheduler": self.scheduler.stats()}
        if self.prefix_cache is not None:
            out["cache"] = self.prefix_cache.stats()
        return out

    def kv_events_stats(self) -> dict[str, Any] | None:
        """The KV event feed's counters (None when events are off); any thread."""
        return self.kv_events.stats() if self.kv_events is not None else None

    def close(self) -> None:
        """Stop the engine thread and the cache, then give back the device memory: the page
        pool and the captured graphs go now, not when the last reference to the service does."""
        self.scheduler.stop()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.prefix_cache is not None:
            self.prefix_cache.close()
        self.engine.release()


def _kv_events(config: KvtierConfig, prefix_cache: Any) -> Any:
    """The KV event feed ``server.kv_events_endpoint`` asks for (before the engine thread runs)."""
    if not config.server.kv_events_endpoint:
        return None
    if prefix_cache is None:
        raise ConfigError("server.kv_events_endpoint", config.server.kv_events_endpoint,
                          "only with the cache on (cache.enabled true): events describe its tiers")
    from kvtier.events import KVEventFeed

    feed = KVEventFeed.from_config(config.server, prefix_cache.tiered.index)
    log.info("KV events on %s (topic %r, replay %s)", feed.publisher.endpoint,
             config.server.kv_events_topic, feed.publisher.replay_endpoint or "off")
    return feed


def _page_source(config: KvtierConfig, lm: CausalLM, prefix_cache: Any) -> Any:
    """The tiered cache's device pages, or (cache off) a device pool of the engine's own sized
    as ``cache.device_pages`` / ``cache.device_memory_fraction`` say."""
    from kvtier.engine.seq_pages import CachedPages, PlainPages

    if prefix_cache is not None:
        return CachedPages(prefix_cache)
    from kvtier.memory.device_pool import DevicePool

    layout = lm.kv_layout(config.cache.page_size)
    return PlainPages(DevicePool.from_config(config.cache, layout, str(lm.device)))


def _decode_graphs(config: KvtierConfig, lm: CausalLM, pages: Any) -> Any:
    """Captured batched decodes on CUDA (``engine.decode_graph_batch`` > 0, a model whose
    forward is embedding, rotary, layers, norm and head); else None (every step eager)."""
    if config.engine.decode_graph_batch <= 0 or not _graphs_serve(lm, "decode graphs"):
        return None
    from kvtier.engine.decode_graphs import DecodeGraphs

    return DecodeGraphs(lm, config.engine.decode_graph_batch, pages.scratch_page)


def _suffix_step(config: KvtierConfig, lm: CausalLM, pages: Any, prefix_cache: Any) -> Any:
    """Captured suffix steps of lone hits on CUDA (the cache on, ``engine.graph_tokens`` > 0,
    a supported model), every bucket captured now; else None (such steps run eagerly)."""
    if (prefix_cache is None or config.engine.graph_tokens <= 0
            or not _graphs_serve(lm, "suffix graphs")):
        return None
    from kvtier.engine.suffix_step import MAX_PAST_TOKENS, SuffixStep

    step = SuffixStep(lm, min(lm.max_positions, MAX_PAST_TOKENS), pages.scratch_page)
    step.warm(pages.kv)
    return step


def _graphs_serve(lm: CausalLM, what: str) -> bool:
    """Whether captured forwards can run ``lm`` (CUDA, a supported model); logs why not."""
    if lm.device.type != "cuda":
        return False
    from kvtier.engine import graphs

    reason = graphs.unsupported_reason(lm)
    if reason is not None:
        log.info("%s off: %s", what, reason)
    return reason is None
