"""Abuse limits at the HTTP edge: requests in flight (429) and the bytes a body really sends (413).

Owns ``RequestLimits`` (a pure ASGI middleware), ``LimitCounters`` (what it refused, for
``/metrics``) and ``install_limits(app, config)``. How it fits with the rest of ``serve``:

- ``app``'s guard checks the OpenAI API key; it runs before this middleware, so a client
  without the key never takes an in-flight slot. A ``Content-Length`` over
  ``server.max_body_bytes`` answers 413 ``body_too_large`` on any route before an in-flight
  slot is taken or the body parsed. This middleware also counts the body bytes actually
  received, so a chunked upload (no ``Content-Length``) cannot pass the limit either.
- A refused body is drained first (read and dropped, at most ``DRAIN_MAX_BYTES`` for at most
  ``DRAIN_MAX_S``), then the 413 is sent with ``Connection: close``: clients that write the
  whole body before reading (urllib, httpx, plain sockets) would otherwise get a connection
  reset instead of the answer. A client that sent ``Expect: 100-continue`` has sent no body
  yet and gets the 413 at once.
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

import asyncio
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
#: A refused body is read and dropped up to this many bytes (64 MiB: under a second on any
#: link a client would send that much over) so that the client can read the 413; past it, or
#: past ``DRAIN_MAX_S``, the connection is closed unread.
DRAIN_MAX_BYTES = 64 << 20
DRAIN_MAX_S = 10.0


@dataclass
class LimitCounters:
    """Requests in flight now, refusals so far and every 4xx answer by status and reason
    (``CountErrors``); event-loop thread only."""

    in_flight: int = 0
    peak_in_flight: int = 0
    rejected_total: dict[str, int] = field(default_factory=dict)
    errors: dict[tuple[int, str], int] = field(default_factory=dict)  # 4xx by (status, reason)

    def reject(self, reason: str) -> None:
        self.rejected_total[reason] = self.rejected_total.get(reason, 0) + 1

    def count_error(self, status: int, reason: str) -> None:
        self.errors[(status, reason)] = self.errors.get((status, reason), 0) + 1

    def snapshot(self) -> dict[str, Any]:
        return {"in_flight": self.in_flight, "peak_in_flight": self.peak_in_flight,
                "rejected_total": dict(self.rejected_total),
                "errors_total": [{"status": s, "reason": r, "count": n}
                                 for (s, r), n in sorted(self.errors.items())]}


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
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if await self._refused_length(scope, receive, send):
            return
        if is_operator_path(scope.get("path", "")):
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

    async def _refused_length(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """Answer 413 (after draining) when ``Content-Length`` exceeds the limit."""
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length", b"").decode("latin-1").strip()
        if not length.isdigit() or int(length) <= self.max_body_bytes:
            return False
        if headers.get(b"expect", b"").lower() != b"100-continue" \
                and int(length) <= DRAIN_MAX_BYTES:
            await drain(receive)
        self.counters.reject("body_too_large")
        await _answer(send, self._too_large(f"request body of {length} bytes"),
                      {"connection": "close"})
        return True

    def _too_large(self, what: str) -> APIError:
        return APIError(413, f"{what} exceeds the limit of {self.max_body_bytes} bytes "
                        "(server.max_body_bytes)", code="body_too_large")

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
                if message.get("more_body", False):
                    await drain(receive)
                self.counters.reject("body_too_large")
                await _answer(send, self._too_large(f"request body of more than "
                                                    f"{self.max_body_bytes} bytes"),
                              {"connection": "close"})
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


async def drain(receive: Receive) -> int:
    """Read and drop what is left of a request body, within ``DRAIN_MAX_BYTES`` and
    ``DRAIN_MAX_S``; returns the bytes dropped."""
    loop = asyncio.get_running_loop()
    deadline, dropped = loop.time() + DRAIN_MAX_S, 0
    while dropped <= DRAIN_MAX_BYTES:
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            break
        dropped += len(message.get("body", b""))
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            break
    return dropped


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
