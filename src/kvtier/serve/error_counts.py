"""Every 4xx answer counted by status and reason, every 5xx by route, for ``/metrics``.

Owns ``CountErrors``, a pure ASGI middleware wrapped around the whole app (guards included),
so every refusal is seen whoever made it: the API-key guard, the limits, schema checks, the
routes, unknown paths. The reason is the ``error.code`` of the answer's OpenAI-shaped JSON body
(else its ``error.type``; ``unknown`` when the body is not that shape); only the first
``MAX_PARSED_BYTES`` of a 4xx body are kept to read it. Counts go to ``LimitCounters.errors``
(rendered as ``kvtier_http_errors_total{status, reason}``). A 5xx answer is counted by the route
that answered (its path template, ``route_of``) in ``LimitCounters.server_errors``
(``kvtier_http_server_errors_total{route, status}``); the 500 of an unhandled exception is
sent outside this middleware, so ``serve.errors`` counts that one. Event-loop thread only.
"""

from __future__ import annotations

import json
from typing import Any

from kvtier.serve.errors import route_of
from kvtier.serve.limits import LimitCounters, Message, Receive, Scope, Send

MAX_PARSED_BYTES = 64 << 10


def error_reason(body: bytes) -> str:
    """``error.code`` (else ``error.type``) of an OpenAI error body; 'unknown' otherwise."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return "unknown"
    if not isinstance(error, dict):
        return "unknown"
    return str(error.get("code") or error.get("type") or "unknown")


class CountErrors:
    """See the module docstring."""

    def __init__(self, app: Any, *, counters: LimitCounters) -> None:
        self.app = app
        self.counters = counters

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        body = bytearray()

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                if status >= 500:
                    self.counters.count_server_error(route_of(scope), status)
            elif message["type"] == "http.response.body" and 400 <= status < 500:
                if len(body) < MAX_PARSED_BYTES:
                    body.extend(message.get("body", b"")[:MAX_PARSED_BYTES - len(body)])
                if not message.get("more_body", False):
                    self.counters.count_error(status, error_reason(bytes(body)))
            await send(message)

        await self.app(scope, receive, watch)
