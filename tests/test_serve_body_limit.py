"""A body over ``server.max_body_bytes`` sent whole before the answer is read still gets its 413.

Python's urllib and plain socket clients write the whole request before they read anything; a
server that answers and closes without reading the body resets such a connection, and the
client sees ``ConnectionResetError`` instead of the 413. Real uvicorn on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest

from test_engine_support import make_config, running_server

LIMIT = 20000
#: Larger than loopback's socket buffers, so an unread body cannot hide in them.
BODY_BYTES = 24 << 20


@pytest.fixture(scope="module")
def url():
    config = make_config(cache__enabled="false", server__max_body_bytes=str(LIMIT))
    with running_server(config) as (_, base):
        yield base


def _body() -> bytes:
    return json.dumps({"model": "tiny-llama", "prompt": "x" * BODY_BYTES}).encode()


def test_urllib_client_sending_a_huge_body_reads_the_413(url):
    request = urllib.request.Request(url + "/v1/completions", data=_body(),
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    assert info.value.code == 413
    error = json.loads(info.value.read())["error"]
    assert error["code"] == "body_too_large" and str(LIMIT) in error["message"]


def test_socket_client_writing_the_whole_body_first_reads_the_413(url):
    host, port = url.removeprefix("http://").split(":")
    body = _body()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert b"body_too_large" in answer


def test_chunked_upload_past_the_limit_reads_the_413(url):
    host, port = url.removeprefix("http://").split(":")
    piece = b"x" * (1 << 20)
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            "\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head + chunk * 16 + b"0\r\n\r\n")
        answer = b""
        while data := sock.recv(65536):
            answer += data
    assert answer.startswith(b"HTTP/1.1 413 ")


def test_client_expecting_100_continue_gets_the_413_without_sending_the_body(url):
    host, port = url.removeprefix("http://").split(":")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {BODY_BYTES}\r\nExpect: 100-continue\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head)
        answer = b""
        while chunk := sock.recv(65536):  # the server closes: it waits for no body
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:80]
