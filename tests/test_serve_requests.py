"""Request bodies as OpenAI's API treats them: malformed JSON and unknown fields get a 400 that
says what and where, documented extensions pass; every 4xx is counted in /metrics by reason;
/v1/models says how long a sequence may be and when the model was loaded."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from test_engine_support import make_config, running_server

PROMPT = {"model": "tiny-llama", "prompt": "x y", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    started = int(time.time())
    with running_server(make_config(cache__enabled="false")) as (service, url):
        yield service, url, started


def _post(url: str, path: str, **kw) -> httpx.Response:
    return httpx.post(url + path, timeout=60, **kw)


def test_malformed_json_says_what_is_wrong_and_where(server):
    resp = _post(server[1], "/v1/completions", content=b'{"model": "tiny-llama",\n  "prompt": }',
                 headers={"content-type": "application/json"})
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_json"
    assert "not valid JSON" in error["message"] and "Expecting value" in error["message"]
    assert "line 2, column 13" in error["message"], error["message"]


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/completions", {**PROMPT, "temprature": 0.5}, "temprature"),
    ("/v1/completions", {**PROMPT, "stream_options": {"include_usage": True, "x": 1}},
     "stream_options.x"),
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": [
        {"role": "user", "content": "hi", "nickname": "bob"}]}, "messages.0.nickname"),
])
def test_unknown_request_field_gets_400_naming_it(server, path, body, field):
    resp = _post(server[1], path, json=body)
    error = resp.json()["error"]
    assert resp.status_code == 400, error
    assert error["code"] == "unknown_parameter" and error["param"] == field
    assert f"unrecognized request argument supplied: {field}" in error["message"]


def test_documented_extensions_are_accepted(server):
    body = {**PROMPT, "cache_salt": "tenant-1", "ignore_eos": True, "seed": 3, "user": "u",
            "stream": True, "stream_options": {"include_usage": True}, "top_p": 0.9}
    resp = _post(server[1], "/v1/completions", json=body)
    assert resp.status_code == 200 and resp.text.rstrip().endswith("data: [DONE]")
    chat = {"model": "tiny-llama", "max_completion_tokens": 2, "parallel_tool_calls": False,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert _post(server[1], "/v1/chat/completions", json=chat).status_code == 200


def test_4xx_answers_are_counted_in_metrics_by_reason(server):
    url = server[1]
    _post(url, "/v1/completions", json={**PROMPT, "bogus": 1})
    _post(url, "/v1/completions", json={**PROMPT, "model": "nope"})
    _post(url, "/v1/completions", json={**PROMPT, "n": 2})
    httpx.get(url + "/v1/nothing-here")
    counts = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if family.name == "kvtier_http_errors":
            for sample in family.samples:
                counts[(sample.labels["status"], sample.labels["reason"])] = sample.value
    for key in (("400", "unknown_parameter"), ("404", "model_not_found"),
                ("400", "unsupported_parameter"), ("404", "unknown_route")):
        assert counts.get(key, 0) >= 1, counts


def test_models_gives_max_model_len_and_the_load_time(server):
    service, url, started = server
    model = httpx.get(url + "/v1/models").json()["data"][0]
    assert model["max_model_len"] == service.lm.max_positions
    assert started - 5 <= model["created"] <= int(time.time())


def test_a_request_the_engine_stops_under_gets_503_shutting_down():
    import threading

    with running_server(make_config(cache__enabled="false")) as (service, url):
        body = {**PROMPT, "max_tokens": 20_000, "ignore_eos": True}
        answer: dict[str, httpx.Response] = {}
        thread = threading.Thread(target=lambda: answer.update(
            resp=_post(url, "/v1/completions", json=body)))
        thread.start()
        deadline = time.monotonic() + 30
        while service.scheduler.stats()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        service.scheduler.stop()
        thread.join(60)
    resp = answer["resp"]
    error = resp.json()["error"]
    assert resp.status_code == 503, error
    assert error["code"] == "ShuttingDown" and "shutting down" in error["message"]
