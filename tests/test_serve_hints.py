"""Cache hints over HTTP: OpenAI's and Anthropic's fields on both completion routes reach the
cache and come back in ``usage.kvtier.cache_hint``; bad values are a 400 naming the field; the
hint counters reach the metrics endpoint."""

from __future__ import annotations

import httpx
import pytest

from test_engine_support import make_config, running_server

PROMPT = list(range(1, 70))   # four full pages of 16 tokens


@pytest.fixture(scope="module")
def server():
    config = make_config(server__max_prompt_tokens=200)
    with running_server(config) as (service, url):
        yield service, url


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json={"model": "tiny-llama", "max_tokens": 2,
                                        "temperature": 0, **body}, timeout=120)


def test_completion_retention_hint_is_applied_and_reported(server):
    resp = _post(server[1], "/v1/completions", {"prompt": PROMPT, "prompt_cache_key": "doc",
                                                "prompt_cache_retention": "24h"})
    assert resp.status_code == 200, resp.text
    hint = resp.json()["usage"]["kvtier"]["cache_hint"]
    assert (hint["retention_s"], hint["key"], hint["source"]) == (86400.0, "doc", "openai")
    assert hint["applied_pages"] == 4 and hint["refused_pages"] == 0


def test_chat_message_cache_control_is_a_hint(server):
    resp = _post(server[1], "/v1/chat/completions", {"messages": [
        {"role": "system", "content": "you are terse",
         "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        {"role": "user", "content": "hello there"}]})
    assert resp.status_code == 200, resp.text
    hint = resp.json()["usage"]["kvtier"]["cache_hint"]
    assert (hint["retention_s"], hint["source"]) == (3600.0, "cache_control")


def test_no_hint_no_cache_hint_in_usage(server):
    resp = _post(server[1], "/v1/completions", {"prompt": PROMPT})
    assert "cache_hint" not in resp.json()["usage"]["kvtier"]


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/completions", {"prompt": PROMPT, "prompt_cache_retention": "1w"},
     "prompt_cache_retention"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_cache_key": ""}, "prompt_cache_key"),
    ("/v1/completions", {"prompt": PROMPT, "cache_control": {"type": "ephemeral", "ttl": "9h"}},
     "cache_control.ttl"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {"type": "forever"}}]}]},
     "messages[0].content[0].cache_control.type"),
])
def test_bad_hint_values_get_400_naming_the_field(server, path, body, field):
    resp = _post(server[1], path, body)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == field and error["message"].startswith(field)


def test_hint_counters_reach_the_metrics(server):
    _post(server[1], "/v1/completions", {"prompt": PROMPT, "prompt_cache_retention": "in_memory"})
    text = httpx.get(server[1] + "/metrics").text
    applied = [line for line in text.splitlines()
               if line.startswith('kvtier_cache_hint_pages_total{outcome="applied"}')]
    assert applied and float(applied[0].split()[-1]) >= 4
