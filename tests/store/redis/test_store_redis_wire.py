"""The Redis store's RESP reader, socket channel and breaker on their own (no server): fragmented
replies, page payloads landing in their buffers, exact consumption, deadlines on reads and on
sends to a peer that stopped reading, and breaker state changes."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvtier.store.redis.breaker import CircuitBreaker
from kvtier.store.redis.channel import Channel, Deadline, DeadlineExceeded, coalesce
from kvtier.store.redis.wire import ProtocolError, ReplyReader, ServerError, pack

HEADER = 8


def bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


def feed(sock: socket.socket, data: bytes, step: int) -> threading.Thread:
    """Send ``data`` in ``step``-byte fragments from another thread."""

    def run() -> None:
        for i in range(0, len(data), step):
            sock.sendall(data[i:i + step])
            time.sleep(0)

    th = threading.Thread(target=run)
    th.start()
    return th


@pytest.mark.parametrize("step", [1, 3, 7, 4096])
def test_page_replies_land_in_their_buffers_however_fragmented(step: int) -> None:
    page = bytes(range(200)) * 5  # 1000 bytes
    stream = (bulk(b"H" * HEADER + page) + b"$-1\r\n" + bulk(b"short") + b"-MOVED 12 1.2.3.4:5\r\n"
              + bulk(b"G" * HEADER + page[::-1]))
    left, right = socket.socketpair()
    with left, right:
        th = feed(left, stream, step)
        reader = ReplyReader(Channel(right, Deadline(5)))
        dests = [memoryview(bytearray(1000)) for _ in range(5)]
        replies = [reader.page(HEADER, d) for d in dests]
        reader.finish()
        th.join()
    assert replies[0] == b"H" * HEADER and bytes(dests[0]) == page
    assert replies[1] is None
    assert replies[2] == 5  # a value of another size is skipped, its length reported
    assert isinstance(replies[3], ServerError) and replies[3].kind == "MOVED"
    assert replies[4] == b"G" * HEADER and bytes(dests[4]) == page[::-1]


def test_reader_never_reads_past_the_header_of_a_page_reply() -> None:
    # Everything is already in the socket; the payload must still arrive by recv_into on the
    # destination, so the reader's own buffer is empty once the header is taken.
    page = b"p" * 5000
    left, right = socket.socketpair()
    with left, right:
        left.sendall(b"$-1\r\n" + bulk(b"H" * HEADER + page))
        reader = ReplyReader(Channel(right, Deadline(5)))
        assert reader.page(HEADER, memoryview(bytearray(5000))) is None
        dest = memoryview(bytearray(5000))
        original_into = reader.into
        seen: list[int] = []

        def spy(view: memoryview) -> None:
            seen.append(len(reader._buf))
            original_into(view)

        reader.into = spy  # type: ignore[method-assign]
        assert reader.page(HEADER, dest) == b"H" * HEADER
        reader.finish()
    assert seen == [0] and bytes(dest) == page


def test_simple_replies_cover_status_integer_error_bulk_and_array() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(b"+OK\r\n:7\r\n-ERR bad\r\n" + bulk(b"info") + b"*2\r\n$1\r\n0\r\n*1\r\n$1\r\nk\r\n")
        reader = ReplyReader(Channel(right, Deadline(5)))
        got = [reader.simple() for _ in range(5)]
        reader.finish()
    assert got[:2] == ["OK", 7] and isinstance(got[2], ServerError)
    assert got[3] == b"info" and got[4] == [b"0", [b"k"]]


def test_status_replies_are_matched_at_once_and_parsed_when_one_differs() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(b"+OK\r\n" * 3 + b"+OK\r\n-OOM command not allowed\r\n+OK\r\n")
        reader = ReplyReader(Channel(right, Deadline(5)))
        assert reader.replies_like(3, b"+OK\r\n") == ["OK"] * 3
        mixed = reader.replies_like(3, b"+OK\r\n")
        reader.finish()
    assert mixed[0] == mixed[2] == "OK"
    assert isinstance(mixed[1], ServerError) and mixed[1].kind == "OOM"


def test_zero_one_replies_are_matched_at_once_and_parsed_when_one_differs() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(b":1\r\n:0\r\n:1\r\n" + b":1\r\n-MOVED 3 127.0.0.1:7001\r\n:0\r\n")
        reader = ReplyReader(Channel(right, Deadline(5)))
        assert reader.small_ints(3) == [1, 0, 1]
        mixed = reader.small_ints(3)
        reader.finish()
    assert mixed[0] == 1 and mixed[2] == 0 and isinstance(mixed[1], ServerError)


def test_a_silent_peer_ends_the_read_at_the_deadline() -> None:
    left, right = socket.socketpair()
    with left, right:
        reader = ReplyReader(Channel(right, Deadline(0.2)))
        start = time.monotonic()
        with pytest.raises((DeadlineExceeded, TimeoutError)):
            reader.simple()
        assert time.monotonic() - start < 1.0


def test_a_send_to_a_peer_that_stopped_reading_ends_at_the_deadline() -> None:
    left, right = socket.socketpair()
    with left, right:
        channel = Channel(left, Deadline(0.3))
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            channel.send([memoryview(bytes(64 << 20))])  # far more than the socket buffers hold
        assert time.monotonic() - start < 1.0
        channel.release()
        assert left.gettimeout() is None  # socketpair sockets start blocking; restored as found


def test_channel_puts_back_the_timeout_it_found() -> None:
    left, right = socket.socketpair()
    with left, right:
        right.settimeout(2.5)
        channel = Channel(right, Deadline(1))
        assert right.gettimeout() is None  # blocking, kernel timeouts armed per call
        channel.release()
        assert right.gettimeout() == 2.5


def test_unexpected_bytes_are_a_protocol_error() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(b"?what\r\n")
        with pytest.raises(ProtocolError):
            ReplyReader(Channel(right, Deadline(5))).simple()


def test_vectored_send_delivers_every_piece_in_order() -> None:
    big = bytes(range(256)) * 1024  # 256 KiB: more than one sendmsg may take
    pieces = [pack(b"SET", b"k"), memoryview(big), b"tail", b"x" * 10]
    assert [len(p) for p in coalesce(pieces)] == [len(pieces[0]), len(big), 14]
    left, right = socket.socketpair()
    received = bytearray()
    with left, right:
        def drain() -> None:
            while len(received) < sum(len(p) for p in pieces):
                received.extend(right.recv(65536))

        th = threading.Thread(target=drain)
        th.start()
        Channel(left, Deadline(5)).send(pieces)
        th.join()
    assert bytes(received) == b"".join(bytes(p) for p in pieces)


class TrickleSocket:
    """A socket whose sendmsg takes at most ``step`` bytes a call (as a slow peer makes it)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.received = bytearray()

    def gettimeout(self) -> None:
        return None

    def settimeout(self, value: float | None) -> None:
        pass

    def setsockopt(self, *args: object) -> None:
        pass

    def sendmsg(self, buffers: list) -> int:
        room = self.step
        for buffer in buffers:
            data = bytes(buffer)[:room]
            self.received += data
            room -= len(data)
            if not room:
                break
        return self.step - room


@pytest.mark.parametrize("step", [1, 7, 1000, 1 << 20])
def test_partial_sends_resume_where_they_stopped(step: int) -> None:
    floats = memoryview(bytearray(range(256)) * 640).cast("f")  # items of 4 bytes
    pieces = [b"head", floats, b"mid" * 5000, memoryview(bytes(range(256)) * 200), b"end"]
    sock = TrickleSocket(step)
    Channel(sock, Deadline(5)).send(pieces)  # type: ignore[arg-type]
    assert bytes(sock.received) == b"".join(bytes(p) for p in pieces)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_consecutive_failures_and_gives_the_prober_one_turn() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failures=2, backoff_s=1.0, max_backoff_s=4.0, clock=clock, seed=0)
    assert breaker.probe_due_in() is None
    assert breaker.allow() and not breaker.record_failure()
    assert breaker.allow() and breaker.record_failure()  # opened
    assert not breaker.allow()
    assert 0.8 <= breaker.probe_due_in() <= 1.2  # the backoff, +-20% jitter
    assert not breaker.begin_probe()  # not due yet
    clock.now = 1.3  # past the backoff
    assert not breaker.allow()      # callers never probe, even when one is due
    assert breaker.probe_due_in() == 0.0
    assert breaker.begin_probe()    # the prober's turn
    assert not breaker.begin_probe()  # one probe at a time
    assert not breaker.allow() and breaker.stats().state == "half_open"
    breaker.record_success()
    assert breaker.allow() and breaker.stats().state == "closed"
    assert breaker.probe_due_in() is None
    assert breaker.stats().rejected == 3


def test_failed_probes_double_the_backoff_up_to_the_cap() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failures=1, backoff_s=1.0, max_backoff_s=3.0, clock=clock, seed=1)
    breaker.allow()
    breaker.record_failure()
    backoffs = []
    for _ in range(4):
        clock.now += 10
        assert breaker.begin_probe()
        breaker.record_failure()
        backoffs.append(breaker.stats().backoff_s)
    assert backoffs == [2.0, 3.0, 3.0, 3.0]
    clock.now += 0.5
    assert not breaker.allow() and not breaker.begin_probe()


def test_success_resets_the_failure_count() -> None:
    breaker = CircuitBreaker(failures=2, clock=FakeClock())
    breaker.record_failure()
    breaker.record_success()
    assert not breaker.record_failure() and not breaker.is_open


@pytest.mark.parametrize("reply", [b"*2\r\n:0\r\n*0\r\n", b"*2\r\n$1\r\n0\r\n:5\r\n"])
def test_a_scan_reply_of_the_wrong_shape_is_a_server_error(reply: bytes) -> None:
    from kvtier.store.redis.ops import server_info

    info = b"$%d\r\n%s\r\n" % (len(b"used_memory:1"), b"used_memory:1")
    left, right = socket.socketpair()
    with left, right:
        left.sendall(info + info + reply)
        work = server_info(b"kv*")
        with pytest.raises(ServerError):
            work(Channel(right, Deadline(5)), ReplyReader(Channel(right, Deadline(5))))
