"""Helpers shared by the engine, serve and OpenAI-client tests (no tests of its own).

Models load once per process (``tiny_lm``), so the suites that need the tiny Llama or Qwen2
share one copy; each test builds its own cache and service around it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvtier.config import KvtierConfig, build_config


@functools.lru_cache(maxsize=4)
def tiny_lm(name: str = "tiny-llama", seed: int = 0) -> Any:
    from kvtier.engine.hf import load_model

    return load_model(name, device="cpu", dtype="float32", seed=seed)


def make_config(**flags: Any) -> KvtierConfig:
    """A config from defaults and ``section.field`` flags only (the environment is ignored)."""
    base = {"engine.device": "cpu", "engine.dtype": "float32", "host.pool_bytes": "8MiB",
            "host.pinned_budget_bytes": "64MiB", "cache.device_pages": 64,
            "cache.page_size": 16}
    base.update({k.replace("__", "."): v for k, v in flags.items()})
    return build_config(env={}, flags=base)


@contextmanager
def running_server(config: KvtierConfig, lm: Any = None, max_running: int = 4) -> Iterator[Any]:
    """An ``EngineService`` behind a real HTTP server on loopback; yields (service, base_url)."""
    from kvtier.engine.service import EngineService
    from kvtier.serve.app import create_app
    from kvtier.serve.background import BackgroundServer

    service = EngineService.build(config, lm=lm or tiny_lm(), max_running=max_running)
    try:
        with BackgroundServer(create_app(service, config)) as server:
            yield service, server.url
    finally:
        service.close()
