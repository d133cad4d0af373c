"""Answers that outlive the route handler's return: the event stream, and a client that left.

Owns ``EventStream`` (a response sending server-sent events from an async iterator of text,
iterated and closed in the request's own task), ``NoAnswer`` (the response for a client that is
gone: nothing is sent) and ``client_gone(receive)`` (an awaitable that returns once the client
disconnected, which ``serve.generation`` watches instead of polling).

Why not Starlette's ``StreamingResponse``: under uvicorn's HTTP/1.1 it iterates the body in a
task of its own and cancels it when the client leaves, so the generators behind the stream
could be closed from one task while another was stepping them. Here the stream ends because
the generation sees the client gone (``serve.generation.ClientGone``) and stops yielding; the
iterator is closed by the task that iterates it. Runs on the server's event loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from starlette.responses import Response

from kvtier.serve.limits import Receive, Scope, Send


class EventStream(Response):
    """``text/event-stream`` from ``events`` (each item one or more SSE lines)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str] | None = None) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        try:
            async with aclosing(self.events) as events:
                async for chunk in events:
                    await send({"type": "http.response.body", "body": chunk.encode(),
                                "more_body": True})
        except OSError:  # a server that reports a closed socket on send (ASGI spec 2.4)
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class NoAnswer(Response):
    """The client is gone: send nothing."""

    def __init__(self) -> None:
        self.status_code = 499
        self.background = None
        self.init_headers({})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        return


def client_gone(receive: Receive) -> Callable[[], Awaitable[Any]]:
    """An awaitable factory returning once ``receive`` reports ``http.disconnect``; call it
    after the request body was read."""

    async def gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    return gone
