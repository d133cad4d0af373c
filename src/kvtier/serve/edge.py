"""The server's edge: uvicorn's HTTP protocol wrapped so each connection is tracked and bounded.

Owns ``EdgeProtocol`` (an ``asyncio.Protocol`` around uvicorn's own, one per connection),
``MarkConnections`` (the outermost ASGI middleware, telling a connection when a request started,
its body is whole and its answer was sent) and ``server_config(app, **options)``, the
``uvicorn.Config`` that ``serve.lifecycle`` and ``serve.background`` run. The rules themselves
(per-client cap, eviction of stalled connections, the header deadline) live in
``serve.connections``; the body deadline and the in-flight slots in ``serve.limits``.

How the two halves meet: each connection's uvicorn protocol is built with a copy of the app
state holding its ``Connection`` (``CONNECTION_KEY``), and uvicorn copies that state into every
request's ``scope["state"]``. An app served without ``EdgeProtocol`` (tests over ASGI) finds no
connection there and is not marked.

Half-closed clients: asyncio closes a transport whose peer sent EOF unless the protocol says
otherwise. ``EdgeProtocol`` keeps it open while a request has begun; one event-loop turn later
(the request's task has then read what arrived), a request whose body is whole is answered and
the connection closed after the answer; otherwise the EOF is passed on as a disconnect.
Event-loop thread only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kvtier.serve.connections import BUSY, IDLE, Connection, ConnectionTable
from kvtier.serve.limits import Message, Receive, Scope, Send

CONNECTION_KEY = "kvtier.connection"


class EdgeProtocol(asyncio.Protocol):
    """uvicorn's protocol for one connection, admitted and tracked by a ``ConnectionTable``."""

    def __init__(self, table: ConnectionTable, inner_class: Callable[..., Any], *,
                 app_state: dict[str, Any], **options: Any) -> None:
        self.conn = Connection(table)
        self.inner = inner_class(app_state={**app_state, CONNECTION_KEY: self.conn}, **options)
        self.admitted = False

    def connection_made(self, transport: Any) -> None:
        self.conn.attach(transport)
        self.admitted = self.conn.table.open(self.conn)
        if self.admitted:
            self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.admitted and not self.conn.closed:
            self.conn.data_received()
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        if not self.admitted:
            return None
        if self.conn.state == IDLE and not self.conn.pending:
            return self.inner.eof_received()  # nothing begun: close as uvicorn would
        asyncio.get_running_loop().call_soon(self._after_eof)
        return True  # keep the transport open to write the answer

    def _after_eof(self) -> None:
        if self.conn.closed:
            return
        if self.conn.state == BUSY:
            self.conn.peer_eof = True  # answered, then closed (``Connection.response_complete``)
        elif self.conn.state == IDLE and not self.conn.pending:
            self.conn.close()  # its answer was sent meanwhile
        else:
            self.conn.close()  # headers or body cut short: the app sees a disconnect

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.lost()
        if self.admitted:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.inner.resume_writing()


def _has_body(scope: Scope) -> bool:
    for name, value in scope.get("headers") or ():
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False


class MarkConnections:
    """ASGI middleware: request started, body whole, answer sent -> the request's connection."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        conn = (scope.get("state") or {}).get(CONNECTION_KEY) if scope["type"] == "http" else None
        if not isinstance(conn, Connection):
            await self.app(scope, receive, send)
            return
        conn.request_started(_has_body(scope))

        async def marked_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                conn.body_complete()
            return message

        async def marked_send(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                conn.response_complete()

        await self.app(scope, marked_receive, marked_send)


def edge_protocol(table: ConnectionTable, http: str = "auto") -> Callable[..., EdgeProtocol]:
    """The ``http`` protocol factory for ``uvicorn.Config``: uvicorn's ``http`` implementation
    wrapped in ``EdgeProtocol``."""
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    inner = import_from_string(HTTP_PROTOCOLS[http])

    def create(**options: Any) -> EdgeProtocol:
        return EdgeProtocol(table, inner, **options)

    return create


def server_config(app: Any, **options: Any) -> Any:
    """``uvicorn.Config(app, **options)``, with ``EdgeProtocol`` when the app has a
    ``ConnectionTable`` (``app.state.connections``, set by ``serve.app.create_app``)."""
    import uvicorn

    table = getattr(getattr(app, "state", None), "connections", None)
    if isinstance(table, ConnectionTable):
        options["http"] = edge_protocol(table, options.get("http", "auto"))
    return uvicorn.Config(app, **options)
