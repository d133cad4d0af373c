"""Abuse limits at the HTTP edge: requests in flight (429) and the bytes a body really sends (413).

Owns ``RequestLimits`` (a pure ASGI middleware), ``LimitCounters`` (what it refused, for
``/metrics``) and ``install_limits(app, config)``. How it fits with the rest of ``serve``:

- ``app``'s guard answers 413 from a ``Content-Length`` header before anything is read, and
  checks the OpenAI API key; it runs before this middleware, so a client without the key never
  takes an in-flight slot. This middleware counts the body bytes actually received, so a
  chunked upload (no ``Content-Length``) cannot pass ``server.max_body_bytes`` either: past the
  limit it stops reading and answers 413 ``body_too_large``.
- At most ``server.max_concurrent_requests`` requests are in flight (arrived, not yet answered,
  streaming included); one more answers 429 ``too_many_requests`` with ``Retry-After`` before
  its body is read, parsed or tokenized. The engine's queue keeps its own bound (429
  ``queue_full``) for callers that submit without HTTP. Operator routes (``/health``,
  ``/metrics``, ``/admin/*``) are never counted or refused, so a saturated server can still be
  watched and managed.
- Prompt length is checked after tokenization by the OpenAI routes (400
  ``context_length_exceeded``, as OpenAI answers), against ``server.max_prompt_tokens``.

Runs on the server's event loop (one thread: the counters need no lock).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.config import KvtierConfig
from kvtier.serve.errors import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

OPERATOR_PREFIXES = ("/health", "/metrics", "/admin")
BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
RETRY_AFTER_S = 1


@dataclass
class LimitCounters:
    """Requests in flight now and refusals so far (event-loop thread only)."""

    in_flight: int = 0
    peak_in_flight: int = 0
    rejected_total: dict[str, int] = field(default_factory=dict)

    def reject(self, reason: str) -> None:
        self.rejected_total[reason] = self.rejected_total.get(reason, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        return {"in_flight": self.in_flight, "peak_in_flight": self.peak_in_flight,
                "rejected_total": dict(self.rejected_total)}


def is_operator_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in OPERATOR_PREFIXES)


class RequestLimits:
    """See the module docstring."""

    def __init__(self, app: Any, *, max_body_bytes: int, max_in_flight: int,
                 counters: LimitCounters) -> None:
        if max_body_bytes < 1 or max_in_flight < 1:
            raise ValueError("max_body_bytes and max_in_flight must be >= 1")
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_in_flight = max_in_flight
        self.counters = counters

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_operator_path(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        counters = self.counters
        if counters.in_flight >= self.max_in_flight:
            counters.reject("too_many_in_flight")
            await _answer(send, APIError(
                429, f"{counters.in_flight} requests are in flight (the limit is "
                f"{self.max_in_flight}, server.max_concurrent_requests); retry after "
                f"{RETRY_AFTER_S} s", code="too_many_requests"),
                {"retry-after": str(RETRY_AFTER_S)})
            return
        counters.in_flight += 1
        counters.peak_in_flight = max(counters.peak_in_flight, counters.in_flight)
        try:
            if scope.get("method", "GET") in BODY_METHODS:
                replay = await self._read_body(receive, send)
                if replay is None:
                    return
                receive = replay
            await self.app(scope, receive, send)
        finally:
            counters.in_flight -= 1

    async def _read_body(self, receive: Receive, send: Send) -> Receive | None:
        """Read the whole body (at most the limit); None when it was refused or the client left,
        else a ``receive`` that hands the body over once, then passes through."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                self.counters.reject("body_too_large")
                await _answer(send, APIError(
                    413, f"request body of more than {self.max_body_bytes} bytes exceeds the "
                    f"limit of {self.max_body_bytes} bytes (server.max_body_bytes)",
                    code="body_too_large"), {"connection": "close"})
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        handed = False

        async def replay() -> Message:
            nonlocal handed
            if not handed:
                handed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay


async def _answer(send: Send, error: APIError, headers: dict[str, str]) -> None:
    payload = json.dumps(error.body()).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": raw})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def install_limits(app: Any, config: KvtierConfig) -> LimitCounters:
    """Add ``RequestLimits`` to a FastAPI app; its counters are kept at ``app.state.limits``."""
    counters = LimitCounters()
    app.state.limits = counters
    app.add_middleware(RequestLimits, max_body_bytes=config.server.max_body_bytes,
                       max_in_flight=config.server.max_concurrent_requests, counters=counters)
    return counters
