"""Open HTTP connections per client address: how many each holds, which are stalled, deadlines.

Owns ``ConnectionTable`` and ``Connection``, the bookkeeping behind ``serve.edge`` (which feeds
them from uvicorn's protocol and from the ASGI app). The rules, all per client address:

- A connection is *stalled* while it waits for a request's headers or body (``idle`` or
  ``reading``), *busy* once its request's body is whole and until the answer is sent.
- A client holds at most ``server.max_connections_per_client`` connections. One more evicts
  that client's oldest stalled connection (closed; counted as ``connection_evicted``), so a
  client whose connections stall cannot lock out a request from the same address that sends
  at once; when all of them are busy, the new connection gets a 429 ``too_many_connections``
  and is closed (counted as such).
- Request headers must arrive whole within ``server.header_timeout_s`` of the connection
  opening or of its previous answer. Past that a connection that had begun a request gets a
  408 and is closed (counted as ``header_timeout``); an idle one is closed silently.
- A client that half-closes its socket after sending a whole request still gets its answer:
  the connection is closed once the answer is sent (``peer_eof``).

Counts go to ``LimitCounters`` (``rejected_total`` by reason, ``connections_open``); lines go
to the ``kvtier.http`` logger at DEBUG (a flood of stalled connections must not flood the log).
Event-loop thread only (uvicorn's protocol callbacks and the app run there): no locks.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from kvtier.serve.limits import LimitCounters

log = logging.getLogger("kvtier.http")

IDLE, READING, BUSY = "idle", "reading", "busy"


def raw_answer(status: int, reason: str, code: str, message: str) -> bytes:
    """A whole HTTP/1.1 answer with an OpenAI-shaped error body and ``Connection: close``, for
    a connection no request cycle owns (refused, timed out before its headers)."""
    kind = "rate_limit_error" if status == 429 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("latin-1") + body


class Connection:
    """One client connection's state; ``serve.edge`` moves it along."""

    def __init__(self, table: ConnectionTable) -> None:
        self.table = table
        self.transport: Any = None
        self.client = "?"
        self.state = IDLE
        self.pending = False  # bytes arrived since the previous answer: a request has begun
        self.peer_eof = False  # the client half-closed: close once the answer is sent
        self.closed = False
        self._deadline: asyncio.TimerHandle | None = None

    @property
    def stalled(self) -> bool:
        return self.state != BUSY

    def attach(self, transport: Any) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.client = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "?"

    # ---- marks: the protocol (bytes, EOF) and the app (request, body, answer) -----------------
    def data_received(self) -> None:
        if self.state == IDLE:
            self.pending = True

    def request_started(self, has_body: bool) -> None:
        self._disarm()
        self.state = READING if has_body else BUSY

    def body_complete(self) -> None:
        if self.state == READING:
            self.state = BUSY

    def response_complete(self) -> None:
        self.state, self.pending = IDLE, False
        if self.peer_eof:
            self.close()
        elif not self.closed:
            self.arm()

    # ---- deadline and closing -------------------------------------------------------------------
    def arm(self) -> None:
        """Start the header deadline (at open, and after each answer)."""
        self._disarm()
        timeout = self.table.header_timeout_s
        if timeout > 0:
            self._deadline = asyncio.get_running_loop().call_later(timeout, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.state != IDLE or self.closed:
            return
        if self.pending:
            self.table.counters.reject("header_timeout")
            log.debug("%s: request headers not whole within %g s (server.header_timeout_s): "
                      "408, closed", self.client, self.table.header_timeout_s)
            self.close(raw_answer(408, "Request Timeout", "request_timeout",
                                  "the request headers did not arrive within "
                                  f"{self.table.header_timeout_s:g} s (server.header_timeout_s)"))
        else:
            self.close()

    def close(self, answer: bytes | None = None) -> None:
        self._disarm()
        if self.transport is not None and not self.transport.is_closing():
            if answer:
                self.transport.write(answer)
            self.transport.close()
        self.table.forget(self)

    def lost(self) -> None:
        """The transport is gone (closed by either side)."""
        self._disarm()
        self.table.forget(self)


class ConnectionTable:
    """The open connections of one server, by client address (oldest first)."""

    def __init__(self, *, max_per_client: int, header_timeout_s: float,
                 counters: LimitCounters) -> None:
        if max_per_client < 1 or header_timeout_s < 0:
            raise ValueError("max_per_client must be >= 1 and header_timeout_s >= 0")
        self.max_per_client = max_per_client
        self.header_timeout_s = header_timeout_s
        self.counters = counters
        self._by_client: dict[str, dict[Connection, None]] = {}

    def open(self, conn: Connection) -> bool:
        """Admit ``conn`` (attached to its transport): False when it was refused and closed."""
        held = self._by_client.setdefault(conn.client, {})
        if len(held) >= self.max_per_client:
            victim = next((c for c in held if c.stalled), None)
            if victim is None:
                self.counters.reject("too_many_connections")
                log.debug("%s: %d connections, all with a request in flight "
                          "(server.max_connections_per_client): 429, closed", conn.client,
                          len(held))
                conn.closed = True
                conn.transport.write(raw_answer(
                    429, "Too Many Requests", "too_many_connections",
                    f"this client holds {len(held)} connections with requests in flight (the "
                    f"limit is {self.max_per_client}, server.max_connections_per_client)"))
                conn.transport.close()
                return False
            self.counters.reject("connection_evicted")
            log.debug("%s: at %d connections (server.max_connections_per_client): closed its "
                      "oldest stalled one (%s)", conn.client, len(held), victim.state)
            victim.close()
            held = self._by_client.setdefault(conn.client, {})  # emptied and dropped at 1
        held[conn] = None
        self.counters.connections_open += 1
        conn.arm()
        return True

    def forget(self, conn: Connection) -> None:
        """Drop ``conn`` (idempotent)."""
        if conn.closed:
            return
        conn.closed = True
        held = self._by_client.get(conn.client)
        if held is not None and conn in held:
            del held[conn]
            self.counters.connections_open -= 1
            if not held:
                del self._by_client[conn.client]

    def count(self, client: str) -> int:
        return len(self._by_client.get(client, ()))
