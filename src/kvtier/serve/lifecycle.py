"""The HTTP server's life around the engine: bind, load, announce, serve, stop.

Owns ``serve(config, explicit, ready)``, what ``kvtier serve`` runs, and ``KvtierServer``
(uvicorn's server with two hooks). Order at start: the socket is bound first (a port in use
fails before the model loads), then the model loads, the pools the user left unset are sized
to it (``serve.sizing``), the tiers are summarized in the log, and ``ready`` (the "serving at"
banner) runs only once uvicorn accepts connections. At stop (Ctrl-C, SIGTERM) the engine is
stopped before uvicorn waits for open connections: every running or queued request then ends
with an error finish event, so a stream sends its error event and ``[DONE]`` and closes
instead of being cancelled mid-write when the graceful-shutdown timeout runs out. SIGTERM is a
graceful stop like Ctrl-C and ``serve`` returns normally (``kvtier serve`` exits 0), whether it
comes while the model loads or while serving. Main thread (the event loop); ``on_stopping``
runs on a worker thread so the loop keeps delivering events.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from kvtier.config import KvtierConfig, setting_name
from kvtier.errors import ConfigError

log = logging.getLogger("kvtier.serve")

GRACEFUL_SHUTDOWN_S = 5


class KvtierServer(uvicorn.Server):
    """``uvicorn.Server`` calling ``on_started`` once it accepts connections and
    ``on_stopping`` (blocking, on a worker thread) before it waits for connections to close."""

    def __init__(self, config: uvicorn.Config, *, on_started: Callable[[], None] | None = None,
                 on_stopping: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self._on_started = on_started
        self._on_stopping = on_stopping

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self._on_started is not None:
            self._on_started()

    async def shutdown(self, sockets: Any = None) -> None:
        if self._on_stopping is not None:
            await asyncio.to_thread(self._on_stopping)
        await super().shutdown(sockets=sockets)


class Terminated(BaseException):
    """SIGTERM arrived; raised by ``stop_on_sigterm``'s handler, caught by ``serve``."""


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """While inside, SIGTERM raises ``Terminated`` (main thread only). uvicorn installs its own
    handlers while it serves and, once it has stopped gracefully, raises the signal again: it
    then lands here too."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(_signum: int, _frame: Any) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def serve(config: KvtierConfig, explicit: set[str] | None = None,
          ready: Callable[[str], None] | None = None) -> None:
    """Bind, load the engine, serve HTTP until interrupted. ``explicit``: the settings the user
    set (the others may be sized to the model)."""
    try:
        with stop_on_sigterm():
            _serve(config, explicit, ready)
    except Terminated:
        log.info("stopped (SIGTERM)")


def _serve(config: KvtierConfig, explicit: set[str] | None,
           ready: Callable[[str], None] | None) -> None:
    from kvtier.engine.hf import load_model
    from kvtier.engine.service import EngineService
    from kvtier.serve.app import create_app
    from kvtier.serve.edge import server_config
    from kvtier.serve.logs import tiers_summary
    from kvtier.serve.preflight import bind_listener
    from kvtier.serve.sizing import size_pools

    listener = bind_listener(config.server.host, config.server.port)
    try:
        engine = config.engine
        lm = load_model(engine.model, device=engine.device, dtype=engine.dtype, seed=engine.seed,
                        attention=engine.attention, deterministic=engine.deterministic,
                        prefill_attention=engine.prefill_attention)
        if config.server.max_model_len > lm.max_positions:
            raise ConfigError(setting_name("server.max_model_len"), config.server.max_model_len,
                              f"at most the model's {lm.max_positions} positions")
        config = size_pools(config, lm, explicit or set())
        service = EngineService.build(config, lm=lm, max_running=engine.max_running)
        try:
            log.info(service.scheduler.call_soon(lambda: tiers_summary(service)).result(30))
        except Exception as exc:  # a store that cannot count its pages must not stop the start
            log.warning("tiers: no summary (%s: %s)", type(exc).__name__, exc)
        app = create_app(service, config)
        base = f"http://{config.server.host}:{listener.getsockname()[1]}"
        server = KvtierServer(
            server_config(app, log_level=config.server.log_level,
                          timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S),
            on_started=(lambda: ready(base)) if ready is not None else None,
            on_stopping=service.scheduler.stop)
        try:
            server.run(sockets=[listener])
        except KeyboardInterrupt:  # uvicorn raises the signal it stopped on again: a clean stop
            pass
    finally:
        listener.close()
