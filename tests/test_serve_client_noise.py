"""What clients do to ``kvtier serve`` leaves no traceback: each is one log line and a count.

One server process (as a user runs it): clients leave before their body is whole, in the middle
of a stream and while a plain answer is generated; then SIGTERM stops it gracefully (exit 0).
The same server answers under ``--served-model-name`` names within ``--max-model-len``."""

from __future__ import annotations

import json
import signal
import socket
import struct
import time

import httpx
import pytest

from test_serve_startup import _free_port, _serve

STREAMS_CUT = 24


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def noisy_clients():
    port = _free_port()
    proc = _serve("--page-size", "16", "--host-pool-bytes", "8MiB", "--server.stats_interval_s",
                  "0", "--served-model-name", "kv-test,kv-alias", "--max-model-len", "512",
                  port=port)
    seen: dict = {"lines": []}
    try:
        for line in proc.stdout:
            seen["lines"].append(line)
            if "kvtier serving" in line:
                break
        url = f"http://127.0.0.1:{port}"
        seen["models"] = httpx.get(url + "/v1/models", timeout=10).json()
        plain = {"model": "kv-alias", "prompt": "x " * 20, "max_tokens": 2, "temperature": 0}
        seen["alias"] = httpx.post(url + "/v1/completions", json=plain, timeout=60).json()
        seen["too_long"] = httpx.post(url + "/v1/completions", timeout=60,
                                      json={**plain, "max_tokens": 500})
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:  # body cut short
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 999\r\n\r\n{\"model\"")
            time.sleep(0.2)
        long = {**plain, "max_tokens": 400, "ignore_eos": True}
        for i in range(STREAMS_CUT):  # streams left after a few events, at varying moments
            with httpx.stream("POST", url + "/v1/completions", json={**long, "stream": True},
                              timeout=60) as resp:
                lines = resp.iter_lines()
                for _ in range(1 + i % 4):
                    next(lines)
        payload = json.dumps(long).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:  # plain, reset
            # (a socket closed with FIN looks half-closed: its answer is still generated)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
            time.sleep(0.3)
        deadline = time.monotonic() + 20
        while _metric(url, 'kvtier_http_client_disconnects_total{phase="response"}') \
                < STREAMS_CUT + 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        seen["metrics"] = httpx.get(url + "/metrics", timeout=10).text
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            rest, _ = proc.communicate(timeout=30)
    seen["output"] = "".join(seen["lines"]) + rest
    seen["code"] = proc.returncode
    return seen


def test_clients_that_leave_are_counted_and_logged_without_a_traceback(noisy_clients):
    output, metrics = noisy_clients["output"], noisy_clients["metrics"]
    assert 'kvtier_http_client_disconnects_total{phase="body"} 1.0' in metrics, metrics
    assert f'kvtier_http_client_disconnects_total{{phase="response"}} {STREAMS_CUT + 1}.0' \
        in metrics
    assert "Traceback" not in output and "already executing" not in output, output
    assert "Exception in ASGI" not in output and "ERROR" not in output, output
    assert output.count("the client left after") == STREAMS_CUT + 1, output


def test_sigterm_stops_the_server_gracefully_with_exit_code_0(noisy_clients):
    assert noisy_clients["code"] == 0, noisy_clients["output"]
    assert "stopped (SIGTERM)" in noisy_clients["output"]


def test_served_model_names_and_max_model_len(noisy_clients):
    models = noisy_clients["models"]["data"]
    assert [m["id"] for m in models] == ["kv-test", "kv-alias"]
    assert {m["max_model_len"] for m in models} == {512}
    assert noisy_clients["alias"]["model"] == "kv-test"
    assert "kvtier serving kv-test at" in noisy_clients["output"]
    too_long = noisy_clients["too_long"]
    assert too_long.status_code == 400
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
