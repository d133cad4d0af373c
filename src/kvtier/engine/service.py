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
from kvtier.engine.hf import CausalLM, load_model
from kvtier.engine.request import GenerationRequest, RequestHandle
from kvtier.engine.runner import Engine
from kvtier.engine.scheduler import Scheduler

log = logging.getLogger("kvtier.engine")


class EngineService:
    """A running engine; ``close()`` stops the thread and the cache."""

    def __init__(self, config: KvtierConfig, lm: CausalLM, prefix_cache: Any = None, *,
                 max_running: int = 4) -> None:
        self.config = config
        self.lm = lm
        self.prefix_cache = prefix_cache
        self.engine = Engine(lm, prefix_cache)
        poll = prefix_cache.poll if prefix_cache is not None else None
        self.scheduler = Scheduler(self.engine, max_running=max_running,
                                   max_pending=config.server.max_concurrent_requests, poll=poll)
        self.scheduler.start()

    @classmethod
    def build(cls, config: KvtierConfig, *, max_running: int = 4, lm: CausalLM | None = None,
              split: str = "plan") -> EngineService:
        """Load the model (unless given) and the cache the config asks for; ``split`` chooses
        how a hit is served (``plan``: the planner's load/recompute split)."""
        lm = lm or load_model(config.engine.model, device=config.engine.device,
                              dtype=config.engine.dtype, seed=config.engine.seed,
                              attention=config.engine.attention,
                              deterministic=config.engine.deterministic)
        prefix_cache = None
        if config.cache.enabled:
            from kvtier.engine.prefix import PrefixCache

            prefix_cache = PrefixCache.build(config, lm, split=split)
        log.info("engine ready: model %s on %s (%s), cache %s", lm.name, lm.device,
                 lm.dtype_name, "on" if prefix_cache else "off")
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

    def close(self) -> None:
        self.scheduler.stop()
        if self.prefix_cache is not None:
            self.prefix_cache.close()
