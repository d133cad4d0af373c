"""Run the kvtier app on a background thread (embedding kvtier in a process, tests, benchmarks).

Owns ``BackgroundServer``: binds a loopback socket first (port 0 picks a free one, so callers
learn the real port before any request), runs uvicorn on a daemon thread, and stops it on
``close()``. Connections go through ``serve.edge`` as under ``kvtier serve``. The uvicorn event
loop runs on that thread; the caller's thread only starts and stops it.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any


class BackgroundServer:
    """``with BackgroundServer(app) as server: server.url`` -> 'http://127.0.0.1:PORT'."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0,
                 start_timeout_s: float = 30.0) -> None:
        import uvicorn

        from kvtier.serve.edge import server_config

        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = self._socket.getsockname()[:2]
        config = server_config(app, log_level="warning", lifespan="on",
                               timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._socket]},
                                        name="kvtier-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
