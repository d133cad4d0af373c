"""Clients that stall, hoard connections or half-close, against a real server on 127.0.0.1.

A client that sends headers and part of a body holds a connection, never a request slot; its
body times out (408), so do headers that never end; one address holds at most
``server.max_connections_per_client`` connections, its oldest stalled one closed for a new
one; a client that half-closes after its request still reads the answer. Every loop here is
bounded and every socket has a timeout."""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from test_engine_support import make_config, running_server

STALLED = 1000
BODY_STALL = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 999\r\n\r\n{")
HEADER_STALL = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le"
GOOD = {"model": "tiny-llama", "prompt": "Return the", "max_tokens": 2, "temperature": 0}


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


@contextlib.contextmanager
def _sockets(url: str, count: int, first_bytes: Iterator[bytes]) -> Iterator[list[socket.socket]]:
    """``count`` connections to ``url``, each having sent its ``first_bytes``; closed at exit."""
    held: list[socket.socket] = []
    try:
        for _, data in zip(range(count), first_bytes, strict=False):
            sock = socket.create_connection(_address(url), timeout=10)
            sock.sendall(data)
            held.append(sock)
        yield held
    finally:
        for sock in held:
            sock.close()


def _room_for(sockets: int) -> None:
    """Raise the open-file limit for this process's client and server sockets, or skip."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = sockets + 512
    if soft >= wanted:
        return
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"needs {wanted} open files, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def _answer(sock: socket.socket, limit_s: float = 10.0) -> bytes:
    """What the server sends until it closes (at most ``limit_s``)."""
    sock.settimeout(limit_s)
    received = b""
    with contextlib.suppress(TimeoutError):
        while chunk := sock.recv(65536):
            received += chunk
    return received


def _metric(url: str, line_start: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _alternating() -> Iterator[bytes]:
    while True:
        yield BODY_STALL
        yield HEADER_STALL


def test_a_thousand_stalled_connections_do_not_lock_out_a_client_of_the_same_address():
    _room_for(2 * STALLED)
    config = make_config(cache__enabled="false", server__max_connections_per_client=32)
    with running_server(config) as (_, url), _sockets(url, STALLED, _alternating()):
        started = time.monotonic()
        answer = httpx.post(url + "/v1/completions", json=GOOD, timeout=30)
        assert answer.status_code == 200, answer.text
        assert time.monotonic() - started < 10
        evicted = _metric(url, 'kvtier_requests_rejected_total{reason="connection_evicted"}')
        assert evicted >= STALLED - 32
        assert _metric(url, "kvtier_http_connections_open") <= 32


def test_stalled_bodies_take_no_request_slot():
    config = make_config(cache__enabled="false")  # 64 requests in flight, the default
    with running_server(config) as (_, url), _sockets(url, 64, iter(lambda: BODY_STALL, None)):
        answer = httpx.post(url + "/v1/completions", json=GOOD, timeout=30)
        assert answer.status_code == 200, answer.text
        assert _metric(url, "kvtier_http_requests_in_flight") == 0


def test_a_stalled_body_gets_408_after_body_timeout():
    config = make_config(cache__enabled="false", server__body_timeout_s="0.5")
    with running_server(config) as (_, url), _sockets(url, 1, iter([BODY_STALL])) as (sock,):
        started = time.monotonic()
        answer = _answer(sock)
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:80]
        assert time.monotonic() - started < 5
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
        assert _metric(url, 'kvtier_requests_rejected_total{reason="body_timeout"}') == 1


def test_headers_that_never_end_get_408_and_a_silent_connection_is_closed():
    config = make_config(cache__enabled="false", server__header_timeout_s="0.5")
    with running_server(config) as (_, url), \
            _sockets(url, 2, iter([HEADER_STALL, b""])) as (partial, silent):
        started = time.monotonic()
        answer = _answer(partial)
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:80]
        assert b"server.header_timeout_s" in answer
        assert _answer(silent) == b""
        assert time.monotonic() - started < 5
        assert _metric(url, 'kvtier_requests_rejected_total{reason="header_timeout"}') == 1


def test_a_client_whose_connections_are_all_busy_gets_429_for_one_more():
    config = make_config(cache__enabled="false", server__max_connections_per_client=2)
    long = {**GOOD, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with running_server(config) as (_, url), httpx.Client(timeout=30) as one, \
            httpx.Client(timeout=30) as two, \
            one.stream("POST", url + "/v1/completions", json=long) as first, \
            two.stream("POST", url + "/v1/completions", json=long) as second:
        lines = first.iter_lines(), second.iter_lines()  # kept: dropping one closes its stream
        assert all(next(it).startswith("data: ") for it in lines)
        with _sockets(url, 1, iter([b""])) as (third,):
            answer = _answer(third)
        assert answer.startswith(b"HTTP/1.1 429 "), answer[:80]
        assert b"too_many_connections" in answer


def _half_closed(url: str, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    with socket.create_connection(_address(url), timeout=10) as sock:
        sock.sendall(head + payload)
        sock.shutdown(socket.SHUT_WR)
        return _answer(sock, 30)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_half_closes_after_its_request_reads_the_answer(stream):
    with running_server(make_config(cache__enabled="false")) as (_, url):
        answer = _half_closed(url, {**GOOD, "max_tokens": 8, "stream": stream})
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert (b"data: [DONE]" in answer) if stream else (b'"finish_reason"' in answer)
