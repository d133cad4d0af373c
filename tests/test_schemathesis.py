"""Schemathesis against the server's own OpenAPI schema: no input gets a 5xx, and it still serves.

Every operation the schema lists is called with generated inputs (valid and invalid), the admin
routes with the admin key, over a real loopback socket. Bounded: a few examples per operation;
generated ``model`` names are replaced by the served one and generation is capped at one token
(``max_tokens`` and the server's default), so the run reaches generation and tests input
handling, not long generations. An attach whose URL asks for a ``file://`` directory is pointed
at a memory store instead, so the run never creates directories wherever a generated path says.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, settings

from test_engine_support import make_config, running_server

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the test extra")

KEY = "admin-" + "s" * 26
EXAMPLES = 5
MAX_TOKENS = 1


@pytest.fixture(scope="module")
def live_server():
    config = make_config(server__admin_key=KEY, server__max_prompt_tokens=32,
                         engine__max_new_tokens=MAX_TOKENS,
                         server__max_body_bytes=16384, controller__min_prefetch_tokens=0,
                         store__disk_url=f"memory://fuzz-{uuid.uuid4().hex}")
    with running_server(config, max_running=2) as (service, url):
        yield service, url


def served_schema() -> dict[str, Any]:
    """The OpenAPI schema the server publishes at /openapi.json (routes only: no engine runs)."""
    from kvtier.serve.app import create_app

    class Unstarted:  # the routes keep a reference; nothing is called while the schema is built
        model_name = "tiny-llama"

    return create_app(Unstarted(), make_config(server__admin_key=KEY)).openapi()


schema = schemathesis.openapi.from_dict(served_schema())


def bounded(case: Any) -> None:
    """Name the served model (so generation itself is fuzzed, not only the 404 for an unknown
    model), cap generation length, and keep attaches off the real filesystem."""
    body = case.body
    if isinstance(body, dict):
        if isinstance(body.get("model"), str):
            body["model"] = "tiny-llama"
        for field in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(field), int) and body[field] > MAX_TOKENS:
                body[field] = MAX_TOKENS
        if isinstance(body.get("url"), str) and body["url"].lower().startswith("file:"):
            body["url"] = f"memory://fuzz-attach-{uuid.uuid4().hex}"


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_generated_request_gets_a_server_error(case: Any, live_server: Any) -> None:
    bounded(case)
    headers = {"Authorization": f"Bearer {KEY}"} if case.path.startswith("/admin") else None
    response = case.call(base_url=live_server[1], headers=headers, timeout=60)
    assert response.status_code < 500, (case.method, case.path, case.body,
                                        response.status_code, response.text[:500])


@pytest.mark.parametrize(("temperature", "top_p"), [(5e-324, 1.0), (1.0, 5e-324), (1e-30, 1e-30)])
def test_sampling_at_the_edges_of_the_schema_picks_the_best_token_not_nan(temperature: float,
                                                                         top_p: float) -> None:
    """Found by this run: a top_p or a temperature below float32's range made every probability
    0 or nan, and the request failed with a 500."""
    import torch

    from kvtier.engine.sampling import Sampler, SamplingParams

    logits = torch.linspace(-3.0, 3.0, 64)
    assert Sampler(SamplingParams(temperature, top_p, seed=0))(logits) == 63


def test_schema_is_the_one_the_server_publishes(live_server: Any) -> None:
    assert httpx.get(live_server[1] + "/openapi.json").json() == served_schema()


def test_server_still_serves_after_the_run(live_server: Any) -> None:
    _, url = live_server
    assert httpx.get(url + "/health").json()["status"] == "ok"
    body = {"model": "tiny-llama", "prompt": "still here", "max_tokens": 2, "temperature": 0}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2
    bindings = httpx.get(url + "/admin/bindings", headers={"Authorization": f"Bearer {KEY}"})
    assert bindings.status_code == 200 and bindings.json()["lags"] == []
