"""One connection's socket, borrowed from redis-py for one call and bounded by the call's deadline.

Owns ``Deadline``, ``DeadlineExceeded`` / ``NoTimeLeft`` and ``Channel``: ``recv_into``,
``recv_scattered`` (vectored receives into many buffers, plain TCP only) and ``send`` (vectored
sends straight from the caller's page buffers) that never wait past the deadline. On a plain TCP
socket the channel switches the socket to blocking mode and arms the kernel's receive and send
timeouts (SO_RCVTIMEO / SO_SNDTIMEO) with the time left, re-arming only as the deadline nears,
so a receive costs one system call instead of CPython's poll-then-receive of sockets that carry a
timeout. TLS sockets keep Python-level timeouts. ``release`` puts back the timeout redis-py set.
Runs on the IO worker thread that called the store; one channel per connection at a time.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from collections.abc import Sequence

_COALESCE_BYTES = 32 << 10   # payloads below this are copied into one send buffer
_MAX_IOV = 512               # buffers per sendmsg / recvmsg_into call (IOV_MAX is 1024 on Linux)
_REARM_SLACK_S = 0.005       # a kernel timeout may outlast the deadline by at most this
_TIMEVAL = struct.Struct("@ll")

MAX_VIEWS = _MAX_IOV         # buffers one ``recv_scattered`` call takes


class DeadlineExceeded(TimeoutError):
    """The call's deadline passed before the server answered."""


class NoTimeLeft(DeadlineExceeded):
    """Too little of the deadline was left to start talking to a server (not its fault)."""


class Deadline:
    """A point in time (monotonic) every socket operation of one call must finish by."""

    def __init__(self, seconds: float) -> None:
        self.total = seconds
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("deadline passed")
        return left


def coalesce(pieces: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    """Merge runs of small pieces into one, keep large payload views as they are."""
    out: list[bytes | memoryview] = []
    run: list[bytes | memoryview] = []
    for piece in pieces:
        if len(piece) >= _COALESCE_BYTES:
            if run:
                out.append(b"".join(run))
                run = []
            out.append(piece)
        else:
            run.append(piece)
    if run:
        out.append(b"".join(run))
    return out


class Channel:
    """A socket plus the deadline of the call using it."""

    def __init__(self, sock: socket.socket, deadline: Deadline) -> None:
        self.sock = sock
        self.deadline = deadline
        self.tls = isinstance(sock, ssl.SSLSocket)
        #: Whether ``recv_scattered`` works here (TLS sockets cannot receive into many buffers).
        self.scatters = not self.tls and hasattr(sock, "recvmsg_into")
        self._saved_timeout = sock.gettimeout()
        self._armed = 0.0  # seconds the kernel timeouts were last set to (0: not yet)
        if not self.tls:
            sock.settimeout(None)

    def _arm(self) -> None:
        left = self.deadline.remaining()
        if self.tls:
            self.sock.settimeout(left)
        elif not self._armed or self._armed > left + _REARM_SLACK_S:
            seconds = max(left, 0.001)
            value = _TIMEVAL.pack(int(seconds), int((seconds % 1) * 1e6))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
            self._armed = seconds

    def recv_into(self, view: memoryview) -> int:
        self._arm()
        try:
            got = self.sock.recv_into(view)
        except BlockingIOError:  # the kernel timeout fired
            raise DeadlineExceeded("no reply before the deadline") from None
        if got == 0:
            raise ConnectionError("server closed the connection")
        return got

    def recv_scattered(self, views: Sequence[memoryview]) -> int:
        """Receive into ``views`` (at most ``MAX_VIEWS``) in order, filling each before the
        next; returns the byte count as soon as any bytes are there."""
        self._arm()
        try:
            got = self.sock.recvmsg_into(views)[0]
        except BlockingIOError:  # the kernel timeout fired
            raise DeadlineExceeded("no reply before the deadline") from None
        if got == 0:
            raise ConnectionError("server closed the connection")
        return got

    def send(self, pieces: Sequence[bytes | memoryview]) -> None:
        """Send every piece in order (vectored where the socket allows: not TLS)."""
        pieces = coalesce(pieces)
        if self.tls:
            for piece in pieces:
                self._arm()
                self.sock.sendall(piece)
            return
        # bytes as they are; anything else as a flat byte view (lengths below count bytes)
        views = [p if type(p) is bytes else memoryview(p).cast("B") for p in pieces]
        start = 0
        while start < len(views):
            self._arm()
            batch = views[start:start + _MAX_IOV]
            try:
                sent = self.sock.sendmsg(batch)
            except BlockingIOError:
                raise DeadlineExceeded("server stopped reading before the deadline") from None
            if sent == sum(map(len, batch)):  # the usual case: all of it
                start += len(batch)
                continue
            while sent and start < len(views):
                if sent >= len(views[start]):
                    sent -= len(views[start])
                    start += 1
                else:
                    views[start] = memoryview(views[start])[sent:]
                    sent = 0

    def release(self) -> None:
        """Give the socket back with the timeout mode redis-py set on it."""
        try:
            self.sock.settimeout(self._saved_timeout)
        except OSError:  # already closed by a disconnect
            pass
