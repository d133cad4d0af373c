"""A streaming client that pauses between reads still gets the whole stream."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

from test_engine_support import make_config, running_server


def _raw_stream(url: str, body: dict, pause_s: float) -> bytes:
    """POST with a raw socket, read the first bytes, pause, then read to the end."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            "Content-Type: application/json\r\nConnection: close\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(head + payload)
        received = sock.recv(256)
        time.sleep(pause_s)
        while chunk := sock.recv(65536):
            received += chunk
    return received


def _streamed_text(raw: bytes) -> tuple[str, str | None]:
    """The completion text of an SSE stream and its last finish reason."""
    text, reason = "", None
    for line in raw.decode("utf-8", "replace").split("\n"):
        if line.startswith("data: {"):
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            reason = choice["finish_reason"] or reason
    return text, reason


def test_stream_survives_a_client_that_pauses_after_the_first_bytes():
    body = {"model": "tiny-llama", "prompt": "Return the answer", "max_tokens": 48,
            "stream": True, "ignore_eos": True, "temperature": 0}
    with running_server(make_config()) as (_service, url):
        eager = _raw_stream(url, body, 0.0)
        paused = _raw_stream(url, body, 2.0)
    assert paused.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in paused
    assert _streamed_text(paused) == _streamed_text(eager)
    assert _streamed_text(paused)[1] == "length"
