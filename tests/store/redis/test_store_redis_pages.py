"""The Redis store's bulk GET reply reader and reply judge, on a socket pair (no server) and on
a real server: pages land in their buffers however the stream is cut, odd replies anywhere in a
run (miss, error, other length) are handed to the general parser, nothing past the batch is
read, a run that ends early never waits for bytes the server does not owe, and the fast header
builder makes exactly ``encode_header``'s bytes."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest
from test_store_redis_wire import feed

from kvtier.store import open_store
from kvtier.store.record import HEADER_BYTES, encode_header
from kvtier.store.redis import RedisStore
from kvtier.store.redis import verify as redis_verify
from kvtier.store.redis.channel import MAX_VIEWS, Channel, Deadline
from kvtier.store.redis.pages import read_pages
from kvtier.store.redis.store import page_views
from kvtier.store.redis.verify import PageJudge, Verdicts
from kvtier.store.redis.wire import ProtocolError, ReplyReader, ServerError, pack, pack_key_command
from redis_server import RedisServer, needs_redis, running_server
from store_contract import key_for, page_bytes_for

HEADER = 8
PAGE = 1000


def bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


def header(i: int) -> bytes:
    return b"%08d" % i


def payload(i: int) -> bytes:
    return random.Random(i).randbytes(PAGE)


def stream_of(kinds: str) -> bytes:
    """h: a page record, m: nil, s: a short value, e: an error, for reply i at position i."""
    parts = {"h": lambda i: bulk(header(i) + payload(i)), "m": lambda i: b"$-1\r\n",
             "s": lambda i: bulk(b"short"), "e": lambda i: b"-MOVED 12 1.2.3.4:5\r\n"}
    return b"".join(parts[kind](i) for i, kind in enumerate(kinds))


def check(kinds: str, replies: list, dests: list[memoryview]) -> None:
    for i, (kind, reply) in enumerate(zip(kinds, replies, strict=True)):
        if kind == "h":
            assert reply == header(i) and bytes(dests[i]) == payload(i), i
        elif kind == "m":
            assert reply is None, i
        elif kind == "s":
            assert reply == 5, i
        else:
            assert isinstance(reply, ServerError) and reply.kind == "MOVED", i


@pytest.mark.parametrize("step", [1, 3, 7, 64, 4096, 1 << 20])
@pytest.mark.parametrize("kinds", ["hhhhhh", "mhhhhh", "hhhhhm", "hhmhhs", "hhehhh", "mmsemh",
                                   "hmhmhmhm"])
def test_runs_of_replies_land_in_their_buffers_however_cut(step: int, kinds: str) -> None:
    left, right = socket.socketpair()
    with left, right:
        th = feed(left, stream_of(kinds), step)
        reader = ReplyReader(Channel(right, Deadline(5)))
        assert reader.channel.scatters
        dests = [memoryview(bytearray(PAGE)) for _ in kinds]
        replies = read_pages(reader, HEADER, dests)
        reader.finish()
        th.join()
    check(kinds, replies, dests)


def test_a_run_after_a_reply_read_the_general_way_takes_the_owed_crlf() -> None:
    kinds = "hhhh"
    left, right = socket.socketpair()
    with left, right:
        left.sendall(stream_of(kinds))
        reader = ReplyReader(Channel(right, Deadline(5)))
        dests = [memoryview(bytearray(PAGE)) for _ in kinds]
        first = reader.page(HEADER, dests[0])  # leaves the CRLF of reply 0 in the socket
        replies = [first, *read_pages(reader, HEADER, dests[1:])]
        reader.finish()
    check(kinds, replies, dests)


def test_a_run_reads_nothing_past_its_replies() -> None:
    kinds = "hhmh"
    left, right = socket.socketpair()
    with left, right:
        left.sendall(stream_of(kinds) + b"+OK\r\n:7\r\n")
        reader = ReplyReader(Channel(right, Deadline(5)))
        dests = [memoryview(bytearray(PAGE)) for _ in kinds]
        replies = read_pages(reader, HEADER, dests)
        assert reader.simple() == "OK" and reader.simple() == 7
        reader.finish()
    check(kinds, replies, dests)


def test_a_run_ending_in_odd_replies_never_waits_for_bytes_not_owed() -> None:
    # The last reply is 5 bytes, fewer than even the fixed bytes of a page reply: the reader
    # must stop at what arrived instead of waiting out the deadline for the rest.
    kinds = "hhhm"
    left, right = socket.socketpair()
    with left, right:
        left.sendall(stream_of(kinds))
        reader = ReplyReader(Channel(right, Deadline(2)))
        dests = [memoryview(bytearray(PAGE)) for _ in kinds]
        start = time.monotonic()
        replies = read_pages(reader, HEADER, dests)
        reader.finish()
    assert time.monotonic() - start < 1
    check(kinds, replies, dests)


def test_more_replies_than_one_receive_takes() -> None:
    count = MAX_VIEWS  # three buffers per reply: several receives even with all bytes there
    kinds = "".join(random.Random(5).choice("hhhhm") for _ in range(count))
    left, right = socket.socketpair()
    with left, right:
        th = feed(left, stream_of(kinds), 1 << 16)
        reader = ReplyReader(Channel(right, Deadline(10)))
        dests = [memoryview(bytearray(PAGE)) for _ in kinds]
        replies = read_pages(reader, HEADER, dests)
        reader.finish()
        th.join()
    check(kinds, replies, dests)


def test_a_bulk_reply_without_its_crlf_is_a_protocol_error() -> None:
    broken = b"$%d\r\n%s\r!" % (HEADER + PAGE, header(0) + payload(0))
    left, right = socket.socketpair()
    with left, right:
        left.sendall(broken + stream_of("h"))
        reader = ReplyReader(Channel(right, Deadline(2)))
        with pytest.raises(ProtocolError):
            read_pages(reader, HEADER, [memoryview(bytearray(PAGE)) for _ in range(2)])


def test_tls_like_channels_take_the_general_path() -> None:
    kinds = "hmhs"
    left, right = socket.socketpair()
    with left, right:
        left.sendall(stream_of(kinds))
        channel = Channel(right, Deadline(5))
        channel.scatters = False
        reader = ReplyReader(channel)
        dests = [memoryview(bytearray(PAGE)) for _ in kinds]
        replies = read_pages(reader, HEADER, dests)
        reader.finish()
    check(kinds, replies, dests)


# ---- the judge ------------------------------------------------------------------------------
@pytest.mark.parametrize("page_bytes", [1, 4096, 65536])
def test_fast_headers_are_exactly_encode_headers(page_bytes: int) -> None:
    judge = PageJudge(page_bytes)
    assert judge._fast
    rng = random.Random(page_bytes)
    for _ in range(50):
        key, data = rng.randbytes(32), memoryview(bytearray(rng.randbytes(page_bytes)))
        assert judge.expected_header(key, data) == encode_header(key, data)
        assert judge.expected_header(bytearray(key), data) == encode_header(key, data)


def test_judge_falls_back_to_encode_header_when_the_layout_differs(monkeypatch) -> None:
    def other_layout(key: bytes, payload: object, checksum: int | None = None) -> bytes:
        return encode_header(key, payload, checksum)[::-1]

    monkeypatch.setattr(redis_verify, "encode_header", other_layout)
    judge = PageJudge(PAGE)
    assert not judge._fast
    key, data = key_for(1), memoryview(bytearray(payload(1)))
    assert judge.expected_header(key, data) == other_layout(key, data)


def test_judge_verdicts() -> None:
    judge = PageJudge(PAGE)
    keys = [key_for(i) for i in range(6)]
    views = [memoryview(bytearray(payload(i))) for i in range(6)]
    good = [encode_header(k, v) for k, v in zip(keys, views, strict=True)]
    replies = [good[0], None, 77, ServerError("WRONGTYPE x"), ServerError("MOVED 1 a:1"),
               good[4]]
    views[4][10] ^= 1  # the payload that arrived is not the one the header was made for
    out = Verdicts(6)
    judge.judge(keys, replies, views, out, range(6))
    assert out.found == [True, False, False, False, False, False]
    assert (out.corrupt, out.errors, out.moved) == (3, 1, True)


# ---- buffers and commands -------------------------------------------------------------------
def test_page_views_take_common_buffers_and_refuse_misfits() -> None:
    rows = np.zeros((2, PAGE), np.uint8)
    views = page_views([rows[0], bytearray(PAGE), np.zeros(PAGE // 4, np.float32)], PAGE,
                       writable=True)
    assert all(v.nbytes == PAGE and v.format == "B" and v.ndim == 1 for v in views)
    views[0][0] = 9
    assert rows[0, 0] == 9
    with pytest.raises(ValueError, match="read-only"):
        page_views([bytes(PAGE)], PAGE, writable=True)
    assert page_views([bytes(PAGE)], PAGE, writable=False)[0].nbytes == PAGE
    with pytest.raises(ValueError, match="bytes"):
        page_views([bytearray(PAGE + 1)], PAGE, writable=True)
    with pytest.raises(ValueError, match="contiguous"):
        page_views([np.zeros((PAGE, 2), np.uint8)[:, 0]], PAGE, writable=True)


def test_page_views_take_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.zeros(PAGE // 2, dtype=torch.float16)
    view = page_views([tensor], PAGE, writable=True)[0]
    view[:2] = b"\x00\x3c"  # 1.0 in float16
    assert tensor[0].item() == 1.0


@pytest.mark.parametrize("keys", [[b"abc", b"def", b"ghi"], [b"abc", b"de", b"fghi"], [b"x"], []])
def test_key_commands_are_pipelined_commands(keys: list[bytes]) -> None:
    assert pack_key_command(b"GET", keys) == b"".join(pack(b"GET", key) for key in keys)


# ---- on a server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_server(tmp_path_factory.mktemp("redis-pages")) as srv:
        yield srv


@needs_redis
@pytest.mark.redis
@pytest.mark.parametrize("page", [512, 70_000])
def test_big_batches_with_scattered_misses_and_damage(server: RedisServer, page: int) -> None:
    count = 400 if page < 4096 else 40
    rng = random.Random(page)
    present = [i for i in range(count) if rng.random() < 0.8]
    damaged = set(rng.sample(present, 3))
    with open_store(server.url(), page_bytes=page, prefix=f"bulk{page}:",
                    batch_bytes=count * page // 3) as store, server.client() as raw:
        assert isinstance(store, RedisStore)
        assert all(store.write([key_for(i) for i in present],
                               [page_bytes_for(i, page) for i in present]))
        for i in damaged:
            name = f"bulk{page}:".encode() + key_for(i).hex().encode()
            value = raw.get(name)
            if i % 2:
                raw.set(name, value[:-1])  # another length
            else:
                at = HEADER_BYTES + page // 2
                raw.setrange(name, at, bytes([value[at] ^ 0x10]))
        buffers = [np.zeros(page, np.uint8) for _ in range(count)]
        found = store.read_into([key_for(i) for i in range(count)], buffers)
        stats = store.stats()
    for i in range(count):
        hit = i in present and i not in damaged
        assert found[i] == hit, i
        if hit:
            assert buffers[i].tobytes() == page_bytes_for(i, page), i
    assert stats.corrupt == len(damaged)
    assert stats.misses == count - len(present) + len(damaged)
