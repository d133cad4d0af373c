"""The units of wire work the Redis page store runs on one server: GET, SET, EXISTS, DEL, INFO.

Each builder returns a ``work(channel, reader)`` function for ``Endpoint.run``: it pipelines its
commands (page reads in chunks of ``batch_bytes``, the next chunk sent before the previous one is
read, the replies of a chunk taken by ``pages``), reads exactly one reply per command, and
returns the replies in order. An error reply that means the server cannot serve (LOADING,
NOAUTH, ...) is raised after the batch, so the call counts as an outage. Runs on the IO worker
thread that called the store.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.store.redis.channel import Channel
from kvtier.store.redis.endpoint import UNAVAILABLE_KINDS, Work
from kvtier.store.redis.pages import read_pages
from kvtier.store.redis.wire import Reply, ReplyReader, ServerError, pack, pack_key_command

#: A server's ``INFO`` fields, numbers where they parse as numbers.
Info = dict[str, int | float | str]


def _raise_unavailable(replies: Sequence[Reply]) -> None:
    for reply in replies:
        if isinstance(reply, ServerError) and reply.kind in UNAVAILABLE_KINDS:
            raise reply


def get_pages(rkeys: Sequence[bytes], views: Sequence[memoryview], header_bytes: int,
              pages_per_trip: int) -> Work[list[Reply]]:
    """GET each key into its view; replies: header bytes, None (nil), int (wrong size), error."""
    chunks = [(start, min(start + pages_per_trip, len(rkeys)))
              for start in range(0, len(rkeys), pages_per_trip)]

    def send(channel: Channel, chunk: tuple[int, int]) -> None:
        start, end = chunk
        channel.send([pack_key_command(b"GET", rkeys[start:end])])

    def work(channel: Channel, reader: ReplyReader) -> list[Reply]:
        replies: list[Reply] = []
        send(channel, chunks[0])
        for n, (start, end) in enumerate(chunks):
            if n + 1 < len(chunks):
                send(channel, chunks[n + 1])  # the server works on it while we read this one
            replies += read_pages(reader, header_bytes, views[start:end])
        _raise_unavailable(replies)
        return replies

    return work


def set_pages(rkeys: Sequence[bytes], headers: Sequence[bytes], payloads: Sequence[memoryview],
              ttl_s: int) -> Work[list[Reply]]:
    """SET each key to header + payload (with EX when ``ttl_s``), sent without joining them."""
    expiry = pack(b"EX", b"%d" % ttl_s)[4:] if ttl_s else b""  # the two bulk args, no array head
    argc = 5 if ttl_s else 3

    def work(channel: Channel, reader: ReplyReader) -> list[Reply]:
        pieces: list[bytes | memoryview] = []
        tail = b""  # the end of the previous command, sent with the start of this one
        for rkey, header, payload in zip(rkeys, headers, payloads, strict=True):
            size = len(header) + len(payload)
            pieces.append(b"%s*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s"
                          % (tail, argc, len(rkey), rkey, size, header))
            pieces.append(payload)
            tail = b"\r\n" + expiry
        pieces.append(tail)
        channel.send(pieces)
        replies = reader.replies_like(len(rkeys), b"+OK\r\n")
        _raise_unavailable(replies)
        return replies

    return work


def per_key(command: bytes, rkeys: Sequence[bytes]) -> Work[list[Reply]]:
    """``command key`` for each key (EXISTS, DEL), pipelined; replies are 0 / 1 or errors."""

    def work(channel: Channel, reader: ReplyReader) -> list[Reply]:
        channel.send([pack_key_command(command, rkeys)])
        replies = reader.small_ints(len(rkeys))
        _raise_unavailable(replies)
        return replies

    return work


def server_info(match: bytes | None) -> Work[Info]:
    """INFO memory and stats, and the key count: DBSIZE, or SCAN ``match`` (exact, slower)."""

    def work(channel: Channel, reader: ReplyReader) -> Info:
        channel.send([pack(b"INFO", b"memory") + pack(b"INFO", b"stats")])
        info: Info = {}
        for _ in range(2):
            reply = reader.simple()
            if isinstance(reply, ServerError):
                raise reply
            info.update(parse_info(reply))
        info["keys"] = _count_keys(channel, reader, match)
        return info

    return work


def _count_keys(channel: Channel, reader: ReplyReader, match: bytes | None) -> int:
    if match is None:
        channel.send([pack(b"DBSIZE")])
        reply = reader.simple()
        if not isinstance(reply, int):
            raise ServerError(str(reply))
        return reply
    cursor, count = b"0", 0
    while True:
        channel.send([pack(b"SCAN", cursor, b"MATCH", match, b"COUNT", b"1000")])
        reply = reader.simple()
        if isinstance(reply, ServerError) or not isinstance(reply, list):
            raise ServerError(str(reply))
        next_cursor, keys = reply
        if not isinstance(next_cursor, bytes) or not isinstance(keys, list):
            raise ServerError(str(reply))
        cursor = next_cursor
        count += len(keys)
        if cursor == b"0":
            return count


def parse_info(text: Reply) -> Info:
    """``INFO`` text as {field: int | float | str}."""
    out: Info = {}
    raw = text.decode(errors="replace") if isinstance(text, bytes) else str(text)
    for line in raw.splitlines():
        if not line or line.startswith("#") or ":" not in line:
            continue
        name, _, value = line.partition(":")
        for kind in (int, float):
            try:
                out[name] = kind(value)
                break
            except ValueError:
                continue
        else:
            out[name] = value
    return out


def glob_escape(text: bytes) -> bytes:
    """``text`` with Redis glob metacharacters escaped, for a literal SCAN MATCH prefix."""
    out = bytearray()
    for byte in text:
        if byte in b"*?[]\\":
            out += b"\\"
        out.append(byte)
    return bytes(out)
