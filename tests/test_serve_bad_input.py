"""Inputs that once answered 500 get a 400 naming the field; every 5xx is counted by route.

A seed past 64 bits, a lone UTF-16 surrogate (JSON can escape one, no tokenizer can encode it)
and a body that is not UTF-8 are the client's mistakes. A 5xx answer, whether a route raised
``APIError`` or an exception escaped, shows in ``kvtier_http_server_errors_total{route,
status}``. Real uvicorn on 127.0.0.1."""

from __future__ import annotations

import httpx
import pytest

from kvtier.serve.errors import APIError
from test_engine_support import make_config, running_server


@pytest.fixture(scope="module")
def server():
    with running_server(make_config(cache__enabled="false")) as (service, url):
        yield service, url


def _post(url: str, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(url + path, content=raw, timeout=30,
                      headers={"content-type": "application/json"})


@pytest.mark.parametrize(("path", "raw", "param", "words"), [
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "a", "seed": 18446744073709551616}',
     "seed", "less than or equal to 18446744073709551615"),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "a\\ud800"}', "prompt",
     "lone UTF-16 surrogate at character 1"),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "a", "stop": ["\\udc00"]}',
     "stop[0]", "lone UTF-16 surrogate"),
    ("/v1/chat/completions",
     b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x\\ud800y"}]}',
     "messages[0].content", "lone UTF-16 surrogate"),
])
def test_input_no_engine_can_take_gets_400_naming_the_field(server, path, raw, param, words):
    answer = _post(server[1], path, raw)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_value"
    assert words in error["message"]


def test_a_body_that_is_not_utf8_gets_400_invalid_json(server):
    answer = _post(server[1], "/v1/completions", b'{"model": "tiny-llama", "prompt": "a\xff"}')
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_json"


def _server_errors(url: str) -> dict[tuple[str, str], float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvtier_http_server_errors_total{"):
            labels, value = line.split("} ")
            pairs = dict(p.split("=") for p in labels.split("{")[1].split(","))
            out[(pairs["route"].strip('"'), pairs["status"].strip('"'))] = float(value)
    return out


def test_every_5xx_answer_is_counted_by_route(server, monkeypatch):
    service, url = server
    body = b'{"model": "tiny-llama", "prompt": "a", "max_tokens": 1}'
    before = _server_errors(url)

    def crash(*_args, **_kwargs):
        raise RuntimeError("engine bug")

    monkeypatch.setattr(service, "submit", crash)
    answer = _post(url, "/v1/completions", body)
    assert answer.status_code == 500 and answer.json()["error"]["type"] == "server_error"

    def unavailable(*_args, **_kwargs):
        raise APIError(503, "stopping", code="ShuttingDown")

    monkeypatch.setattr(service, "submit", unavailable)
    assert _post(url, "/v1/chat/completions", body.replace(
        b'"prompt": "a"', b'"messages": [{"role": "user", "content": "a"}]')).status_code == 503
    after = _server_errors(url)
    assert after.get(("/v1/completions", "500"), 0) == before.get(("/v1/completions", "500"), 0) + 1
    assert after.get(("/v1/chat/completions", "503"), 0) == \
        before.get(("/v1/chat/completions", "503"), 0) + 1
