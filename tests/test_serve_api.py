"""The HTTP surface over a real socket: 4xx answers, guards, health, SSE framing, concurrency."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

from test_engine_support import make_config, running_server


@pytest.fixture(scope="module")
def server():
    config = make_config(cache__enabled="false", server__max_prompt_tokens=200,
                         server__max_body_bytes=20000)
    with running_server(config) as (service, url):
        yield service, url


def _post(url: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60, **kw)


def _error(resp: httpx.Response) -> dict:
    return resp.json()["error"]


def test_health_and_models_name_the_served_model(server):
    _, url = server
    assert httpx.get(url + "/health").json()["status"] == "ok"
    models = httpx.get(url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny-llama"]


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"model": "tiny-llama"}, 400, "prompt: Field required"),
    ({"model": "tiny-llama", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny-llama", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "nope", "prompt": "x"}, 404, "is not served here"),
    ({"model": "tiny-llama", "prompt": "x " * 300}, 400, "at most 200"),
    ({"model": "tiny-llama", "prompt": [5, 6], "max_tokens": 40000}, 400, "positions"),
    ({"model": "tiny-llama", "prompt": ["a", "b"]}, 400, "one prompt per request"),
    ({"model": "tiny-llama", "prompt": "x", "n": 3}, 400, "only n=1"),
    ({"model": "tiny-llama", "prompt": "x", "echo": True}, 400, "echo"),
    ({"model": "tiny-llama", "prompt": [5, 10**7]}, 400, "vocabulary"),
    ({"model": "tiny-llama", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
])
def test_bad_completion_requests_get_a_clear_4xx(server, body, status, words):
    resp = _post(server[1], "/v1/completions", body)
    assert resp.status_code == status
    assert words in _error(resp)["message"]


@pytest.mark.parametrize(("body", "words"), [
    ({"model": "tiny-llama", "messages": []}, "messages"),
    ({"model": "tiny-llama", "messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"model": "tiny-llama", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "text only"),
    ({"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function"}]}, "tool calling"),
])
def test_bad_chat_requests_get_400(server, body, words):
    resp = _post(server[1], "/v1/chat/completions", body)
    assert resp.status_code == 400 and words in _error(resp)["message"]


def test_malformed_json_gets_400_not_422(server):
    resp = httpx.post(server[1] + "/v1/completions", content=b"{not json",
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400


def test_oversized_body_gets_413_before_parsing(server):
    resp = _post(server[1], "/v1/completions", {"model": "tiny-llama", "prompt": "x" * 30000})
    assert resp.status_code == 413 and "exceeds the limit" in _error(resp)["message"]


def test_completion_usage_counts_prompt_and_completion_tokens(server):
    resp = _post(server[1], "/v1/completions",
                 {"model": "tiny-llama", "prompt": [0, 5, 6, 7], "max_tokens": 5, "temperature": 0,
                  "ignore_eos": True})
    body = resp.json()
    assert resp.status_code == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] == "length"
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (4, 5, 9)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert set(usage["kvtier"]["cached_tokens_by_tier"]) == {"device", "host", "disk", "remote"}


def _sse_events(resp: httpx.Response) -> list:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_streamed_completion_ends_with_usage_then_done(server):
    body = {"model": "tiny-llama", "prompt": "Return", "max_tokens": 4, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", server[1] + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(resp)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 4
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    plain = _post(server[1], "/v1/completions", {**body, "stream": False}).json()
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == plain["choices"][0]["text"]


def test_a_stream_sends_one_chunk_per_token_even_while_its_text_is_incomplete(server):
    """Token ids the tokenizer cannot turn into text yet (most of the tiny model's 128k ids
    are past its 1k-token vocabulary) still get their chunk, so a client times every token."""
    body = {"model": "tiny-llama", "prompt": [5, 6, 7], "max_tokens": 9, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server[1] + "/v1/completions", json=body, timeout=60) as resp:
        events = _sse_events(resp)
    texts = [e["choices"][0]["text"] for e in events[:-1] if e["choices"][0]["finish_reason"]
             is None]
    assert len(texts) == 9


def test_stop_string_ends_the_answer_before_it(server):
    base = {"model": "tiny-llama", "prompt": "Return the", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    full = _post(server[1], "/v1/completions", base).json()["choices"][0]["text"]
    stop = full[3:5]
    cut = _post(server[1], "/v1/completions", {**base, "stop": stop}).json()["choices"][0]
    assert cut["text"] == full[:full.find(stop)]
    assert cut["finish_reason"] == "stop"


def test_concurrent_requests_all_complete(server):
    body = {"model": "tiny-llama", "prompt": "Tell", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: _post(server[1], "/v1/completions",
                                                {**body, "user": f"u{i % 3}"}), range(12)))
    assert all(a.status_code == 200 for a in answers)
    texts = {a.json()["choices"][0]["text"] for a in answers}
    assert len(texts) == 1  # greedy: the same prompt gives the same answer under load


def test_api_key_guards_the_v1_routes_only():
    config = make_config(cache__enabled="false", server__api_key="sesame")
    with running_server(config) as (_, url):
        assert httpx.get(url + "/v1/models").status_code == 401
        ok = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200
        assert httpx.get(url + "/health").status_code == 200


def test_queue_limit_answers_429():
    config = make_config(cache__enabled="false", server__max_concurrent_requests=1)
    body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True}
    with running_server(config, max_running=1) as (_, url), \
            concurrent.futures.ThreadPoolExecutor(6) as pool:
        codes = sorted(pool.map(lambda _: _post(url, "/v1/completions", body).status_code,
                                range(6)))
    assert codes[0] == 200 and 429 in codes
