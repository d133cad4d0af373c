"""``/metrics`` times each request end to end and each gap between its tokens, and shows the
server process's memory, file descriptors and open connections. Real uvicorn on 127.0.0.1."""

from __future__ import annotations

import httpx

from test_engine_support import make_config, running_server


def _values(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_end_to_end_and_inter_token_latency_and_process_gauges():
    with running_server(make_config(cache__enabled="false")) as (_, url), \
            httpx.Client(base_url=url, timeout=30) as client:
        body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 5, "ignore_eos": True,
                "temperature": 0}
        assert client.post("/v1/completions", json=body).status_code == 200
        values = _values(client.get("/metrics").text)
    assert values["kvtier_e2e_request_latency_seconds_count"] == 1
    assert values["kvtier_e2e_request_latency_seconds_sum"] > 0
    assert values["kvtier_inter_token_latency_seconds_count"] == 4  # 5 tokens, 4 gaps
    assert values['kvtier_inter_token_latency_seconds_bucket{le="+Inf"}'] == 4
    assert values["process_resident_memory_bytes"] > 10 << 20
    assert values["process_open_fds"] >= 1
    assert values["kvtier_http_connections_open"] >= 1  # this client's
