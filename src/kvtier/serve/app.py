"""The FastAPI application: routers, ``/health``, the API-key guard, limits and error counts.

Owns ``create_app(service, config)`` and ``/health``: 200 while the engine runs, with
``status`` "degraded" and the reason under ``tiers`` while a store tier is off or failing (the
engine serves without it: a cache problem is no reason to restart or unroute the server), 503
once the engine stopped. Routers come from the modules in ``ROUTER_MODULES``, each
exposing ``build_router(service, config)`` (the OpenAI routes, the admin API and ``/metrics``).
``server.api_key`` guards ``/v1/*`` with a bearer key (``serve.auth.ApiKeyGuard``);
``serve.limits`` refuses oversized and late bodies and too many requests in flight;
``serve.error_counts`` counts every 4xx and 5xx answer; ``serve.edge.MarkConnections``,
outermost, tells each connection's ``ConnectionTable`` entry (``app.state.connections``) where
its request stands. All of them are pure ASGI middlewares.
While the app runs, a task logs the stats line every ``server.stats_interval_s`` seconds
(``serve.logs``). FastAPI is imported inside functions only, so the engine and benchmarks never
need it; uvicorn runs the app from ``serve.lifecycle`` and ``serve.background``. The event loop
runs on the main thread (``kvtier serve``) or a background thread; the engine on its own.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from typing import Any

from kvtier.config import KvtierConfig
from kvtier.serve.auth import ApiKeyGuard
from kvtier.serve.connections import ConnectionTable
from kvtier.serve.edge import MarkConnections
from kvtier.serve.error_counts import CountErrors
from kvtier.serve.errors import install_error_handlers
from kvtier.serve.limits import install_limits
from kvtier.serve.logs import log_stats_every

log = logging.getLogger("kvtier.serve")

#: Modules that contribute routes, each with ``build_router(service, config) -> APIRouter``.
ROUTER_MODULES: tuple[str, ...] = (
    "kvtier.serve.openai_api",
    "kvtier.serve.admin_api",
)


def create_app(service: Any, config: KvtierConfig) -> Any:
    """The ASGI app over a running ``EngineService``; closing the app closes the service."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    @asynccontextmanager
    async def lifespan(_app: Any) -> Any:
        interval = config.server.stats_interval_s
        ticker = asyncio.create_task(log_stats_every(service, interval)) if interval else None
        try:
            yield
        finally:
            if ticker is not None:
                ticker.cancel()
            service.close()

    app = FastAPI(title="kvtier", version=_version(), lifespan=lifespan)
    app.state.service = service
    app.state.config = config
    install_error_handlers(app)
    counters = install_limits(app, config)  # inside the guard: keyless requests take no slot
    app.add_middleware(ApiKeyGuard, api_key=config.server.api_key)
    app.add_middleware(CountErrors, counters=counters)  # sees every answer but unhandled 500s
    app.add_middleware(MarkConnections)  # outermost: request, body and answer of a connection
    app.state.connections = ConnectionTable(
        max_per_client=config.server.max_connections_per_client,
        header_timeout_s=config.server.header_timeout_s, counters=counters)

    @app.get("/health")
    async def health() -> Any:
        tiers = _store_health(service)
        status = "ok" if service.alive else "engine stopped"
        if service.alive and any(t.get("state") != "on" for t in tiers.values()):
            status = "degraded"  # serving: a store tier is off or failing (``tiers`` says why)
        body = {"status": status, "model": service.model_name, **service.scheduler.stats(),
                "tiers": tiers}
        return JSONResponse(body, status_code=200 if service.alive else 503)

    for name in ROUTER_MODULES:
        app.include_router(importlib.import_module(name).build_router(service, config))
    return app


def _store_health(service: Any) -> dict[str, dict[str, Any]]:
    """The store guards' states (thread-safe: read here, not on the engine thread)."""
    prefix_cache = getattr(service, "prefix_cache", None)
    if prefix_cache is None:
        return {}
    health: dict[str, dict[str, Any]] = prefix_cache.tiered.store_health()
    return health


def _version() -> str:
    from kvtier import __version__

    return __version__
