"""One Redis server as the page store sees it: connections, circuit breaker, deadline-bound calls.

Owns ``Endpoint``: ``run(work, deadline)`` executes a unit of wire work (``ops``) on one of
the server's connections and turns every failure into ``EndpointDown`` (counted by the breaker;
one retry on a fresh connection when a kept one turns out dead, e.g. after a restart). The
endpoint keeps the connections it took from redis-py's pool on a shelf of its own, because a
pool checkout costs tens of microseconds per call; a kept connection is checked for a closed
or dirty socket (one zero-timeout poll) before each use and reconnected when needed, and every
kept connection is dropped when the breaker opens. While the breaker is open a prober thread of
the endpoint's own (a daemon, started when the breaker opens, gone once it closes or the
endpoint closes; it catches everything) sends ``PING`` each time the breaker's backoff passes and
closes the breaker on the first answer, so the store serves again within one backoff of the
server's return whether or not anyone calls, and no caller ever waits on a probe. Also owns the
reply kinds that mean "server unavailable" and "slot moved". Called from the IO worker threads
that call the store.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvtier.store.redis.breaker import CircuitBreaker
from kvtier.store.redis.channel import Channel, Deadline, NoTimeLeft
from kvtier.store.redis.wire import ReplyReader, ServerError, connection_socket, pack

log = logging.getLogger(__name__)
T = TypeVar("T")
Work = Callable[[Channel, ReplyReader], T]

#: Error replies that mean the server cannot serve now (the whole call fails, the breaker counts).
UNAVAILABLE_KINDS = frozenset({"LOADING", "BUSY", "NOAUTH", "WRONGPASS", "NOPERM", "MASTERDOWN",
                               "CLUSTERDOWN", "TRYAGAIN", "READONLY"})
#: Error replies that mean the cluster's slot map changed under us.
MOVED_KINDS = frozenset({"MOVED", "ASK"})

#: Shares of a call's deadline for opening a connection: the TCP connect, and each handshake
#: reply (AUTH, SELECT, CLIENT SETNAME: at most three). A connection is only opened while this
#: much time is left, so opening one never pushes a call past its deadline.
CONNECT_SHARE = 1 / 4
HANDSHAKE_REPLY_SHARE = 1 / 8
SETUP_SHARE = CONNECT_SHARE + 3 * HANDSHAKE_REPLY_SHARE


class EndpointDown(Exception):
    """A call to one server failed (breaker open, unreachable, too slow, or not ready)."""

    def __init__(self, endpoint: str, reason: str, cause: BaseException | None = None) -> None:
        super().__init__(f"redis {endpoint}: {reason}")
        self.endpoint = endpoint
        self.cause = cause


def _socket_dirty(conn: Any) -> bool:
    """True if an idle connection's socket is readable: the server closed it, or sent data
    nobody asked for. Either way it must be reconnected before use."""
    sock = getattr(conn, "_sock", None)
    if sock is None:
        return True
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))


def _require_time(deadline: Deadline, share: float = 0.0) -> None:
    """Raise ``NoTimeLeft`` unless more than ``share`` of the call's deadline is left."""
    if deadline.at - time.monotonic() <= max(deadline.total * share, 0.0):
        raise NoTimeLeft("too little of the deadline left to " +
                         ("open a connection" if share else "start"))


def ping(channel: Channel, reader: ReplyReader) -> None:
    """The prober's unit of work: ``PING``, answered ``PONG`` (an error reply such as LOADING
    is raised: the server is not ready)."""
    channel.send([pack(b"PING")])
    reply = reader.simple()
    if isinstance(reply, ServerError):
        raise reply


class Endpoint:
    """One Redis server: its connection pool, the connections kept from it, its breaker."""

    def __init__(self, name: str, pool: Any, breaker: CircuitBreaker, *,
                 probe_timeout_s: float = 1.0) -> None:
        self.name = name
        self.pool = pool
        self.breaker = breaker
        self.probe_timeout_s = probe_timeout_s
        self._lock = threading.Lock()
        self._shelf: list[Any] = []   # idle connections taken from the pool
        self._closed = False
        self._prober: threading.Thread | None = None
        self._stop = threading.Event()

    def run(self, work: Work[T], deadline: Deadline) -> T:
        """``work(channel, reader)`` on a connection; raises ``EndpointDown`` on failure."""
        if not self.breaker.allow():
            raise EndpointDown(self.name, "circuit open (recent failures)")
        try:
            result = self._attempt_with_one_retry(work, deadline)
        except NoTimeLeft as exc:  # the call ran out of time before reaching this server
            raise EndpointDown(self.name, str(exc), exc) from exc
        except Exception as exc:
            if self.breaker.record_failure():
                log.warning("redis %s: circuit opened after %s", self.name, exc)
                self._drop_idle()
                self._start_prober()
            raise EndpointDown(self.name, f"{type(exc).__name__}: {exc}", exc) from exc
        self.breaker.record_success()
        return result

    def probe(self, work: Work[T], deadline: Deadline) -> T:
        """``work`` on a connection, bypassing the breaker; raises what it raised."""
        return self._attempt(work, deadline)

    # ---- the prober -------------------------------------------------------------------------
    def _start_prober(self) -> None:
        with self._lock:
            if self._prober is not None or self._closed:
                return
            self._prober = threading.Thread(target=self._probe_until_closed, daemon=True,
                                            name=f"kvtier-redis-probe-{self.name}")
            self._prober.start()

    def _probe_until_closed(self) -> None:
        """PING whenever the breaker's backoff passes, until it closes (or the endpoint)."""
        while not self._stop.is_set():
            with self._lock:
                wait = self.breaker.probe_due_in()
                if wait is None:  # closed: a later opening starts a new prober
                    self._prober = None
                    return
            if wait > 0:
                self._stop.wait(wait)
            elif self.breaker.begin_probe():
                self._probe_once()

    def _probe_once(self) -> None:
        try:
            self._attempt(ping, Deadline(self.probe_timeout_s))
        except Exception as exc:  # any failure means the server is still away
            self.breaker.record_failure()
            self._drop_idle()
            log.debug("redis %s: probe failed: %s", self.name, exc)
            return
        self.breaker.record_success()
        log.warning("redis %s: answering again; circuit closed", self.name)

    def _attempt_with_one_retry(self, work: Work[T], deadline: Deadline) -> T:
        from redis.exceptions import AuthenticationError
        from redis.exceptions import ConnectionError as RedisConnectionError

        try:
            return self._attempt(work, deadline)
        except AuthenticationError:
            raise
        except (RedisConnectionError, ConnectionError) as first:
            # A kept connection may predate a server restart: one retry on a fresh one.
            self._drop_idle()
            try:
                return self._attempt(work, deadline)
            except NoTimeLeft:
                raise first from None

    def _attempt(self, work: Work[T], deadline: Deadline) -> T:
        _require_time(deadline)
        conn = self._checkout(deadline)
        channel: Channel | None = None
        healthy = False
        try:
            channel = Channel(connection_socket(conn), deadline)
            reader = ReplyReader(channel)
            result = work(channel, reader)
            reader.finish()
            healthy = True
            return result
        finally:
            if channel is not None:
                channel.release()
            self._checkin(conn, healthy)

    # ---- the shelf of kept connections -------------------------------------------------
    def _checkout(self, deadline: Deadline) -> Any:
        with self._lock:
            conn = self._shelf.pop() if self._shelf else None
        if conn is None:
            _require_time(deadline, SETUP_SHARE)
            return self.pool.get_connection()  # connected, counted against max_connections
        try:
            if _socket_dirty(conn):
                conn.disconnect()
                _require_time(deadline, SETUP_SHARE)
                conn.connect()
        except BaseException:
            self._checkin(conn, False)
            raise
        return conn

    def _checkin(self, conn: Any, healthy: bool) -> None:
        if not healthy:
            conn.disconnect()  # reconnects on its next checkout
        with self._lock:
            if not self._closed:
                self._shelf.append(conn)
                return
        self.pool.release(conn)

    def _drop_idle(self) -> None:
        with self._lock:
            idle = list(self._shelf)
        for conn in idle:
            conn.disconnect()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._closed = True
            prober = self._prober
        if prober is not None:
            prober.join(self.probe_timeout_s + 1.0)  # a probe in flight ends by its deadline
        with self._lock:
            idle, self._shelf = self._shelf, []
        for conn in idle:
            self.pool.release(conn)
        self.pool.disconnect()
