"""Abuse limits at the HTTP edge: requests in flight (429), the bytes a body really sends (413)
and how long it takes to send them (408).

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
- A body must arrive whole within ``server.body_timeout_s`` of its headers; past that the
  request answers 408 ``request_timeout`` with ``Connection: close`` (counted as
  ``body_timeout``). A client that leaves before its body is whole gets one INFO line and a
  count (``LimitCounters.disconnects["body"]``), no traceback.
- A request takes an in-flight slot only once its body is whole: a client that sends headers
  and a few bytes holds a connection (bounded per client by ``serve.connections``), never a
  slot. At most ``server.max_concurrent_requests`` requests are in flight (body received, not
  yet answered, streaming included); one more answers 429 ``too_many_requests`` with
  ``Retry-After`` before its body is parsed or tokenized. The engine's queue keeps its own bound (429
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
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.config import KvtierConfig
from kvtier.serve.errors import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger("kvtier.http")

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
    connections_open: int = 0
    rejected_total: dict[str, int] = field(default_factory=dict)
    errors: dict[tuple[int, str], int] = field(default_factory=dict)  # 4xx by (status, reason)
    server_errors: dict[tuple[str, int], int] = field(default_factory=dict)  # 5xx by route
    disconnects: dict[str, int] = field(default_factory=dict)  # clients gone, by phase

    def reject(self, reason: str) -> None:
        self.rejected_total[reason] = self.rejected_total.get(reason, 0) + 1

    def count_error(self, status: int, reason: str) -> None:
        self.errors[(status, reason)] = self.errors.get((status, reason), 0) + 1

    def count_server_error(self, route: str, status: int) -> None:
        self.server_errors[(route, status)] = self.server_errors.get((route, status), 0) + 1

    def disconnected(self, phase: str) -> None:
        """A client left before its answer was whole: ``body`` (while sending its body),
        ``response`` (while its answer was being generated or streamed)."""
        self.disconnects[phase] = self.disconnects.get(phase, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        return {"in_flight": self.in_flight, "peak_in_flight": self.peak_in_flight,
                "connections_open": self.connections_open,
                "rejected_total": dict(self.rejected_total),
                "disconnects_total": dict(self.disconnects),
                "errors_total": [{"status": s, "reason": r, "count": n}
                                 for (s, r), n in sorted(self.errors.items())],
                "server_errors_total": [{"route": r, "status": s, "count": n}
                                        for (r, s), n in sorted(self.server_errors.items())]}


def is_operator_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in OPERATOR_PREFIXES)


class RequestLimits:
    """See the module docstring."""

    def __init__(self, app: Any, *, max_body_bytes: int, max_in_flight: int,
                 counters: LimitCounters, body_timeout_s: float = 60.0) -> None:
        if max_body_bytes < 1 or max_in_flight < 1 or body_timeout_s <= 0:
            raise ValueError("max_body_bytes and max_in_flight must be >= 1, body_timeout_s > 0")
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_in_flight = max_in_flight
        self.body_timeout_s = body_timeout_s
        self.counters = counters

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if await self._refused_length(scope, receive, send):
            return
        if scope.get("method", "GET") in BODY_METHODS:
            replay = await self._read_body(scope, receive, send)
            if replay is None:
                return
            receive = replay
        if is_operator_path(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        counters = self.counters
        if counters.in_flight >= self.max_in_flight:
            counters.reject("too_many_in_flight")
            await answer(send, APIError(
                429, f"{counters.in_flight} requests are in flight (the limit is "
                f"{self.max_in_flight}, server.max_concurrent_requests); retry after "
                f"{RETRY_AFTER_S} s", code="too_many_requests"),
                {"retry-after": str(RETRY_AFTER_S)})
            return
        counters.in_flight += 1
        counters.peak_in_flight = max(counters.peak_in_flight, counters.in_flight)
        try:
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
        await answer(send, self._too_large(f"request body of {length} bytes"),
                      {"connection": "close"})
        return True

    def _too_large(self, what: str) -> APIError:
        return APIError(413, f"{what} exceeds the limit of {self.max_body_bytes} bytes "
                        "(server.max_body_bytes)", code="body_too_large")

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """Read the whole body (at most the limit, within ``body_timeout_s``); None when it was
        refused, timed out or the client left, else a ``receive`` that hands the body over
        once, then passes through."""
        chunks: list[bytes] = []
        try:
            async with asyncio.timeout(self.body_timeout_s):
                whole = await self._receive_body(receive, chunks)
        except TimeoutError:
            self.counters.reject("body_timeout")
            log.info("%s: the body did not arrive within %g s (server.body_timeout_s; %d bytes "
                     "received): 408", _who(scope), self.body_timeout_s, sum(map(len, chunks)))
            await answer(send, APIError(
                408, f"the request body did not arrive within {self.body_timeout_s:g} s "
                "(server.body_timeout_s)", code="request_timeout"), {"connection": "close"})
            return None
        if whole is _TOO_LARGE_MORE or whole is _TOO_LARGE_END:
            if whole is _TOO_LARGE_MORE:
                await drain(receive)
            self.counters.reject("body_too_large")
            await answer(send, self._too_large(f"request body of more than "
                                                f"{self.max_body_bytes} bytes"),
                          {"connection": "close"})
            return None
        if whole is None:
            self.counters.disconnected("body")
            log.info("%s: the client left before sending the whole body (%d bytes received)",
                     _who(scope), sum(map(len, chunks)))
            return None
        body = bytes(whole)
        handed = False

        async def replay() -> Message:
            nonlocal handed
            if not handed:
                handed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay

    async def _receive_body(self, receive: Receive, chunks: list[bytes]) -> object:
        """The body (bytes), None when the client left, ``_TOO_LARGE_*`` past the limit (more
        of the body to come, or not); ``chunks`` holds what arrived so far."""
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return _TOO_LARGE_MORE if message.get("more_body", False) else _TOO_LARGE_END
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


_TOO_LARGE_MORE, _TOO_LARGE_END = object(), object()  # ``_receive_body`` past the limit


def _who(scope: Scope) -> str:
    client = scope.get("client") or ("?", 0)
    return f"{client[0]}:{client[1]} {scope.get('method', '')} {scope.get('path', '')}"


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


async def answer(send: Send, error: APIError, headers: dict[str, str]) -> None:
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
                       max_in_flight=config.server.max_concurrent_requests, counters=counters,
                       body_timeout_s=config.server.body_timeout_s)
    return counters
