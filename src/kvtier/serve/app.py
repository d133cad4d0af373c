"""The FastAPI application: routers, ``/health``, the API key and body-size guards, and ``serve``.

Owns ``create_app(service, config)`` and ``serve(config)``. Routers come from the modules in
``ROUTER_MODULES``, each exposing ``build_router(service, config)`` (the OpenAI routes now; the
admin API and ``/metrics`` add themselves there). ``server.api_key`` guards ``/v1/*`` with a
bearer key; bodies above ``server.max_body_bytes`` get 413 before they are parsed. FastAPI and
uvicorn are imported here only, so the engine and benchmarks never need them. The event loop
runs on the main thread; the engine on its own.
"""

from __future__ import annotations

import hmac
import importlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kvtier.config import KvtierConfig
from kvtier.serve.errors import APIError, install_error_handlers
from kvtier.serve.limits import install_limits

log = logging.getLogger("kvtier.serve")

#: Modules that contribute routes, each with ``build_router(service, config) -> APIRouter``.
ROUTER_MODULES: tuple[str, ...] = (
    "kvtier.serve.openai_api",
    "kvtier.serve.admin_api",
)


def _guard(config: KvtierConfig) -> Callable[[Any, Callable[[Any], Awaitable[Any]]], Awaitable[Any]]:
    api_key = config.server.api_key
    max_body = config.server.max_body_bytes

    async def guard(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
        from fastapi.responses import JSONResponse

        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body:
            err = APIError(413, f"request body of {length} bytes exceeds the limit of "
                           f"{max_body} bytes", code="body_too_large")
            return JSONResponse(err.body(), status_code=413)
        if api_key and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                err = APIError(401, "missing or wrong API key (send 'Authorization: Bearer "
                               "KEY')", code="invalid_api_key")
                return JSONResponse(err.body(), status_code=401)
        return await call_next(request)

    return guard


def create_app(service: Any, config: KvtierConfig) -> Any:
    """The ASGI app over a running ``EngineService``; closing the app closes the service."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    @asynccontextmanager
    async def lifespan(_app: Any) -> Any:
        yield
        service.close()

    app = FastAPI(title="kvtier", version=_version(), lifespan=lifespan)
    app.state.service = service
    app.state.config = config
    install_error_handlers(app)
    install_limits(app, config)  # inside the guard: keyless requests take no in-flight slot
    app.middleware("http")(_guard(config))

    @app.get("/health")
    async def health() -> Any:
        body = {"status": "ok" if service.alive else "engine stopped",
                "model": service.model_name, **service.scheduler.stats()}
        return JSONResponse(body, status_code=200 if service.alive else 503)

    for name in ROUTER_MODULES:
        app.include_router(importlib.import_module(name).build_router(service, config))
    return app


def _version() -> str:
    from kvtier import __version__

    return __version__


def serve(config: KvtierConfig, *, ready: Callable[[str], None] | None = None) -> None:
    """Load the engine, then serve HTTP until interrupted."""
    import uvicorn

    from kvtier.engine.service import EngineService

    service = EngineService.build(config)
    app = create_app(service, config)
    base = f"http://{config.server.host}:{config.server.port}"
    if ready is not None:
        ready(base)
    uvicorn.run(app, host=config.server.host, port=config.server.port, log_level="info",
                timeout_graceful_shutdown=5)
