"""Abuse limits at the HTTP edge: real body bytes (413) and requests in flight (429)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from kvtier.serve.limits import LimitCounters, RequestLimits, is_operator_path
from test_engine_support import make_config, running_server


class EchoApp:
    """An ASGI app that reads the whole body and answers its length; ``hold`` keeps it busy."""

    def __init__(self) -> None:
        self.calls = 0
        self.hold: asyncio.Event | None = None

    async def __call__(self, scope, receive, send):  # type: ignore[no-untyped-def]
        self.calls += 1
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if self.hold is not None:
            await self.hold.wait()
        payload = json.dumps({"bytes": len(body)}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": payload})


def call(app, path: str, chunks: list[bytes], method: str = "POST") -> tuple[int, dict, dict]:
    """Drive ``app`` with a body sent in ``chunks``; returns (status, headers, json body)."""
    return asyncio.run(_call(app, path, chunks, method))


async def _call(app, path, chunks, method):  # type: ignore[no-untyped-def]
    queue = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
             for i, c in enumerate(chunks)]
    sent: list[dict] = []

    async def receive():  # type: ignore[no-untyped-def]
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(message):  # type: ignore[no-untyped-def]
        sent.append(message)

    await app({"type": "http", "method": method, "path": path, "headers": []}, receive, send)
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, json.loads(body)


def limited(inner: EchoApp, body: int = 100, in_flight: int = 2) -> RequestLimits:
    return RequestLimits(inner, max_body_bytes=body, max_in_flight=in_flight,
                         counters=LimitCounters())


def test_chunked_body_past_the_limit_gets_413_and_never_reaches_the_app() -> None:
    inner = EchoApp()
    app = limited(inner, body=100)
    status, headers, body = call(app, "/v1/completions", [b"x" * 60, b"x" * 60])
    assert status == 413 and inner.calls == 0
    assert body["error"]["code"] == "body_too_large"
    assert "limit of 100 bytes" in body["error"]["message"]
    assert app.counters.rejected_total == {"body_too_large": 1}
    assert app.counters.in_flight == 0


def test_body_within_the_limit_reaches_the_app_whole() -> None:
    inner = EchoApp()
    status, _, body = call(limited(inner, body=100), "/v1/completions", [b"a" * 50, b"b" * 50])
    assert status == 200 and body == {"bytes": 100}


def test_requests_past_the_in_flight_limit_get_429_with_retry_after() -> None:
    async def scenario() -> list[tuple[int, dict, dict]]:
        inner = EchoApp()
        inner.hold = asyncio.Event()
        app = limited(inner, in_flight=2)
        busy = [asyncio.create_task(_call(app, "/v1/models", [b""], "GET")) for _ in range(2)]
        await asyncio.sleep(0.05)
        refused = await _call(app, "/v1/completions", [b"{}"], "POST")
        assert app.counters.in_flight == 2
        inner.hold.set()
        done = await asyncio.gather(*busy)
        assert app.counters.in_flight == 0 and app.counters.peak_in_flight == 2
        return [refused, *done]

    refused, first, second = asyncio.run(scenario())
    assert refused[0] == 429 and refused[1]["retry-after"] == "1"
    assert refused[2]["error"]["code"] == "too_many_requests"
    assert "2 requests are in flight (the limit is 2" in refused[2]["error"]["message"]
    assert first[0] == second[0] == 200


@pytest.mark.parametrize(("path", "operator"), [
    ("/health", True), ("/metrics", True), ("/admin", True), ("/admin/storage", True),
    ("/v1/models", False), ("/adminx", False), ("/healthz", False)])
def test_operator_paths_are_exactly_health_metrics_and_admin(path: str, operator: bool) -> None:
    assert is_operator_path(path) is operator


def _chunks(total: int, size: int = 4096) -> Iterator[bytes]:
    while total > 0:
        yield b" " * min(size, total)
        total -= size


def test_live_server_refuses_a_chunked_upload_past_max_body_bytes() -> None:
    config = make_config(cache__enabled="false", server__max_body_bytes=10000)
    with running_server(config) as (_, url):
        resp = httpx.post(url + "/v1/completions", content=_chunks(50000),
                          headers={"content-type": "application/json"}, timeout=30)
        assert "content-length" not in resp.request.headers
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "body_too_large"
        assert httpx.get(url + "/health").status_code == 200


def test_saturated_server_answers_429_yet_health_metrics_and_admin_still_answer() -> None:
    config = make_config(cache__enabled="false", server__max_concurrent_requests=1)
    long = {"model": "tiny-llama", "prompt": "x", "max_tokens": 2000, "ignore_eos": True,
            "stream": True, "temperature": 0}
    with running_server(config, max_running=1) as (_, url), \
            httpx.stream("POST", url + "/v1/completions", json=long, timeout=60) as held:
        assert held.status_code == 200
        lines = held.iter_lines()  # kept: dropping the iterator closes the stream
        next(lines)  # streaming: it holds the only slot
        refused = httpx.post(url + "/v1/completions", json={"model": "tiny-llama", "prompt": "y"})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "too_many_requests"
        assert httpx.get(url + "/health").status_code == 200
        metrics = httpx.get(url + "/metrics").text
        assert 'kvtier_requests_rejected_total{reason="too_many_in_flight"} 1.0' in metrics
        assert "kvtier_http_requests_in_flight 1.0" in metrics
        assert httpx.get(url + "/admin/stats").status_code == 403  # answered, not queued
        held.close()  # the client leaves: its slot is given back
        deadline = time.monotonic() + 10
        while "kvtier_http_requests_in_flight 0.0" not in httpx.get(url + "/metrics").text:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert httpx.post(url + "/v1/completions", json={"model": "tiny-llama", "prompt": "y",
                                                         "max_tokens": 1}).status_code == 200


def test_a_body_still_arriving_takes_no_slot() -> None:
    config = make_config(cache__enabled="false", server__max_concurrent_requests=1)
    started, finish = threading.Event(), threading.Event()

    def slow_upload() -> Iterator[bytes]:  # sends part of its body, then waits
        yield b'{"model": "tiny-llama", '
        started.set()
        finish.wait(30)
        yield b'"prompt": "x", "max_tokens": 1}'

    with running_server(config, max_running=1) as (_, url), \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        holder = pool.submit(httpx.post, url + "/v1/completions", content=slow_upload(),
                             headers={"content-type": "application/json"}, timeout=60)
        assert started.wait(10)
        time.sleep(0.2)  # the first chunk reaches the server
        served = httpx.post(url + "/v1/completions", json={"model": "tiny-llama", "prompt": "y",
                                                           "max_tokens": 1})
        assert served.status_code == 200, served.text
        finish.set()
        assert holder.result().status_code == 200
