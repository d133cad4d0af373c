"""The RESP wire format of the Redis page store: command encoding and the reply reader.

Owns ``pack`` / ``pack_key_command`` (RESP command encoding) and ``ReplyReader``, which reads
replies through a ``Channel`` (``channel``) over the socket of a connection redis-py opened
(redis-py keeps doing connect, AUTH, TLS, SELECT, pooling and cluster topology). Reading
ourselves lets a GET reply's payload land in the caller's buffer with one copy (the kernel's)
instead of four (socket buffer, parser buffer, bytes object, caller).

Invariant of ``ReplyReader``: it never holds more bytes than the line and record header of the
next page-sized bulk reply, so a payload is always read by ``recv_into`` on the destination;
the one exception is what a bulk page reader (``pages``) received past a reply it could
not take and hands back with ``resume`` (at most one pipelined chunk). It
consumes exactly the replies it was asked for, leaving the connection clean for the pool; on
any exception the caller must disconnect the connection (its state is then unknown).

Every socket operation waits at most until the call's deadline (the channel's job). Runs on
the IO worker thread that called the store; one connection is used by one thread at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

from kvtier.store.redis.channel import Channel

MISS = None  # a nil bulk reply

#: One reply as ``ReplyReader`` parses it: a status line (str), an integer, an error, a bulk
#: string (bytes, or a page's header), ``MISS`` (nil) or an array of replies.
Reply: TypeAlias = "str | int | bytes | ServerError | None | list[Reply]"
_CRLF = b"\r\n"
_MAX_LINE = 64 << 10         # longest reply line accepted
_SCRATCH_BYTES = 64 << 10    # receive buffer for reply lines, headers and skipped values


class ProtocolError(ConnectionError):
    """The server sent something this reader does not expect; the connection is unusable."""


class ServerError(Exception):
    """An error reply (``-ERR ...``): the first word is ``kind`` (MOVED, LOADING, NOAUTH...)."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.kind = line.split(" ", 1)[0]


def pack(*args: bytes) -> bytes:
    """One RESP command (an array of bulk strings)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(parts)


def pack_key_command(command: bytes, keys: Sequence[bytes]) -> bytes:
    """``command key`` for each key, as one buffer of pipelined RESP commands."""
    head = b"*2\r\n$%d\r\n%s\r\n" % (len(command), command)
    sizes = set(map(len, keys))
    if len(sizes) == 1:  # keys of one length (a store's keys): one join
        start = head + b"$%d\r\n" % sizes.pop()
        return start + (b"\r\n" + start).join(keys) + b"\r\n"
    return b"".join([head + b"$%d\r\n%s\r\n" % (len(key), key) for key in keys])


def connection_socket(conn: Any) -> Any:
    """The socket of a connected redis-py connection (the one private attribute we rely on)."""
    sock = getattr(conn, "_sock", None)
    if sock is None:
        raise ConnectionError("connection is not connected")
    return sock


class ReplyReader:
    """Reads RESP replies from one socket; page payloads land straight in caller buffers."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._buf = bytearray()
        self._owed = 0  # bytes of a consumed bulk's trailing CRLF still in the socket
        self._scratch_area: bytearray | None = None  # made on first use (not every call needs it)

    @property
    def _scratch(self) -> bytearray:
        if self._scratch_area is None:
            self._scratch_area = bytearray(_SCRATCH_BYTES)
        return self._scratch_area

    # ---- socket ------------------------------------------------------------------------
    def _recv_some(self, at_most: int) -> None:
        view = memoryview(self._scratch)[:min(at_most, len(self._scratch))]
        got = self._channel.recv_into(view)
        self._buf += view[:got]

    def _settle_owed(self) -> None:
        if self._owed and len(self._buf) >= self._owed:
            if self._buf[:self._owed] != _CRLF[-self._owed:]:
                raise ProtocolError("bulk reply not terminated by CRLF")
            del self._buf[:self._owed]
            self._owed = 0

    # ---- lines and exact byte counts ----------------------------------------------------
    def line(self, window: int = _MAX_LINE) -> bytes:
        """The next reply line (without CRLF). Reads at most ``window`` bytes past a line start
        that has not arrived yet, so it never reads into a page payload that follows."""
        while True:
            self._settle_owed()
            if not self._owed:
                end = self._buf.find(_CRLF)
                if end >= 0:
                    text = bytes(self._buf[:end])
                    del self._buf[:end + 2]
                    return text
                if len(self._buf) > _MAX_LINE:
                    raise ProtocolError("reply line too long")
            if self._owed:  # the buffer holds part of a CRLF and nothing of the line yet
                room = self._owed - len(self._buf) + window
            else:           # the buffer holds the start of the line; read up to the window
                held = len(self._buf)
                room = window - held if held < window else window
            self._recv_some(room)

    def exact(self, nbytes: int) -> bytes:
        """Exactly the next ``nbytes`` bytes (reads no further)."""
        self._settle_owed()
        while len(self._buf) - self._owed < nbytes:
            self._recv_some(self._owed + nbytes - len(self._buf))
            self._settle_owed()
        out = bytes(self._buf[:nbytes])
        del self._buf[:nbytes]
        return out

    def into(self, dest: memoryview) -> None:
        """Fill ``dest`` with the next ``len(dest)`` bytes: from the socket, not via a copy."""
        self._settle_owed()
        if self._owed:
            self.exact(0)
        have = min(len(self._buf), len(dest))
        dest[:have] = self._buf[:have]
        del self._buf[:have]
        pos = have
        recv_into = self._channel.recv_into
        while pos < len(dest):
            pos += recv_into(dest[pos:])

    def skip(self, nbytes: int) -> None:
        """Discard the next ``nbytes`` bytes."""
        while nbytes:
            step = min(nbytes, len(self._scratch))
            self.into(memoryview(self._scratch)[:step])
            nbytes -= step

    # ---- handing the socket to a bulk page reader (``pages``) ------------------------
    @property
    def channel(self) -> Channel:
        return self._channel

    def idle_owed(self) -> int | None:
        """With nothing buffered, the bytes of a consumed bulk's CRLF still in the socket (the
        socket is otherwise at a reply boundary); None while the reader holds bytes."""
        return None if self._buf else self._owed

    def resume(self, unparsed: bytes) -> None:
        """A bulk reader consumed everything owed and read ``unparsed`` past the replies it
        took: those bytes are the start of the next reply."""
        self._owed = 0
        self._buf[:0] = unparsed

    def finish(self) -> None:
        """Consume a trailing CRLF still owed; the reader must then hold nothing."""
        if self._owed:
            self.exact(0)
        if self._buf:
            raise ProtocolError(f"{len(self._buf)} unexpected bytes after the replies")

    # ---- replies ------------------------------------------------------------------------
    def simple(self) -> Reply:
        """One reply that is not a page: status, integer, error, bulk, array or nil."""
        text = self.line()
        kind, body = text[:1], text[1:]
        if kind == b"+":
            return body.decode()
        if kind == b":":
            return int(body)
        if kind == b"-":
            return ServerError(body.decode(errors="replace"))
        if kind == b"$":
            size = int(body)
            if size < 0:
                return MISS
            data = self.exact(size)
            self._owed = 2
            return data
        if kind == b"*":
            count = int(body)
            return MISS if count < 0 else [self.simple() for _ in range(count)]
        raise ProtocolError(f"unexpected reply {text[:40]!r}")

    def replies_like(self, count: int, expected: bytes) -> list[Reply]:
        """``count`` replies; when every one is the status line ``expected`` (``+OK``), one
        compare instead of ``count`` parses. Only for the last replies in flight (it reads
        ``count * len(expected)`` bytes, which every reply of such a batch has at least)."""
        data = self.exact(count * len(expected))
        if data == expected * count:
            return [expected[1:-2].decode()] * count
        self._buf[:0] = data  # something else (an error reply): parse them one by one
        return [self.simple() for _ in range(count)]

    def small_ints(self, count: int) -> list[Reply]:
        """``count`` replies that are ``:0`` / ``:1`` (EXISTS, DEL of one key) matched in bulk;
        parsed one by one when any is something else. Only for the last replies in flight."""
        data = self.exact(4 * count)
        if (data[0::4] == b":" * count and data[2::4] == b"\r" * count
                and data[3::4] == b"\n" * count and not data[1::4].strip(b"01")):
            return [digit - 48 for digit in data[1::4]]
        self._buf[:0] = data
        return [self.simple() for _ in range(count)]

    def _page_fast(self, head: bytes, header_bytes: int, dest: memoryview) -> bytes | None:
        """The header of a full-size reply received in one piece, its payload then read into
        ``dest``; None (bytes kept for the general path) when the reply is anything else."""
        prefix = _CRLF[2 - self._owed:] + head
        want = len(prefix) + header_bytes
        view = memoryview(self._scratch)[:want]
        got = self._channel.recv_into(view)
        if got != want or view[:len(prefix)] != prefix:
            self._buf += view[:got]
            return None
        header = bytes(view[len(prefix):])
        recv_into, pos, size = self._channel.recv_into, 0, len(dest)
        while pos < size:  # the buffer is empty: the payload comes straight from the socket
            pos += recv_into(dest[pos:] if pos else dest)
        self._owed = 2
        return header

    def page(self, header_bytes: int, dest: memoryview) -> bytes | int | ServerError | None:
        """One GET reply of a ``header + len(dest)`` record: the header (payload now in
        ``dest``), ``MISS``, the length of a value of another size (skipped), or an error."""
        expected = header_bytes + len(dest)
        head = b"$%d\r\n" % expected
        if not self._buf:  # the usual case: try to take CRLF + line + header in one receive
            header = self._page_fast(head, header_bytes, dest)
            if header is not None:
                return header
        text = self.line(window=len(head) + header_bytes)
        kind, body = text[:1], text[1:]
        if kind == b"-":
            return ServerError(body.decode(errors="replace"))
        if kind != b"$":
            raise ProtocolError(f"unexpected reply to GET {text[:40]!r}")
        size = int(body)
        if size < 0:
            return MISS
        if size != expected:
            self.skip(size)
            self._owed = 2
            return size
        header = self.exact(header_bytes)
        self.into(dest)
        self._owed = 2
        return header
