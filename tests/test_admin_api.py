"""The admin API on a live server: storage changes, idleness, redaction, validation, flush."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import pytest

from kvtier.engine.request import GenerationRequest
from redis_server import free_port
from test_engine_support import make_config, running_server

KEY = "admin-" + "k" * 26
AUTH = {"Authorization": f"Bearer {KEY}"}


def admin(url: str, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, url + "/admin" + path, headers=AUTH, timeout=60, **kw)


def complete(url: str, prompt: str) -> dict[str, Any]:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]


@pytest.fixture(scope="module")
def server():
    config = make_config(server__admin_key=KEY, controller__min_prefetch_tokens=0,
                         store__disk_url=f"memory://admin-disk-{uuid.uuid4().hex}")
    with running_server(config, max_running=1) as (service, url):
        yield service, url


def wait_until(predicate: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_attach_and_detach_are_refused_with_the_counts_while_requests_are_in_progress(server):
    service, url = server
    long = GenerationRequest(tuple(range(5, 40)), max_new_tokens=5000, stop_token_ids=())
    running, queued = service.submit(long), service.submit(long)
    try:
        wait_until(lambda: service.scheduler.stats()["running"] == 1)
        attach = admin(url, "PUT", "/storage", json={"tier": "remote", "url": "memory://r"})
        assert attach.status_code == 409
        assert "(1 queued, 1 running)" in attach.json()["error"]["message"]
        detach = admin(url, "DELETE", "/storage", params={"tier": "disk"})
        assert detach.status_code == 409 and "running" in detach.json()["error"]["message"]
        resize = admin(url, "POST", "/storage/resize", json={"tier": "disk", "max_bytes": "64MiB"})
        assert resize.status_code == 200  # a resize needs no idleness
    finally:
        queued.cancel()
        running.cancel()
    wait_until(lambda: service.scheduler.stats()["running"] == 0)
    assert admin(url, "GET", "/storage").json()["stores"][0]["attached"]


def test_storage_lifecycle_flush_reload_resize_clear_detach_attach(server):
    service, url = server
    prompt = "The tiered cache keeps pages of attention state. " * 3
    first = complete(url, prompt)
    assert service.prefix_cache.settle()
    stores = admin(url, "GET", "/storage").json()["stores"]
    assert stores[0]["tier"] == "disk" and stores[0]["pages"] > 0 and stores[0]["healthy"]
    flushed = admin(url, "POST", "/flush").json()["dropped_pages"]
    assert flushed["device"] > 0
    again = complete(url, prompt)  # device and host were dropped: the disk tier serves it
    assert again["kvtier"]["cached_tokens_by_tier"]["disk"] > 0
    assert again["prompt_tokens"] == first["prompt_tokens"]
    page = service.prefix_cache.tiered.ctx.device_pool.layout.page_bytes
    resized = admin(url, "POST", "/storage/resize", json={"tier": "disk", "max_bytes": page})
    assert resized.status_code == 200 and resized.json()["pages_after"] <= 1
    assert admin(url, "GET", "/storage").json()["stores"][0]["capacity_bytes"] == page
    cleared = admin(url, "POST", "/storage/clear", json={"tier": "disk"}).json()
    assert cleared["pages_after"] == 0
    detached = admin(url, "DELETE", "/storage", params={"tier": "disk"})
    assert detached.status_code == 200
    assert admin(url, "DELETE", "/storage", params={"tier": "disk"}).status_code == 404
    new = f"memory://admin-disk2-{uuid.uuid4().hex}"
    attached = admin(url, "PUT", "/storage", json={"tier": "disk", "url": new,
                                                    "max_bytes": "8MiB"})
    assert attached.status_code == 200 and attached.json()["attached"] == new
    complete(url, prompt + " again")
    bindings = admin(url, "GET", "/bindings").json()
    assert bindings["lags"] == [] and bindings["slots"]["store.disk"]["generation"] >= 3


def test_host_pool_rebuild_over_http_keeps_serving_from_cache(server):
    service, url = server
    rebuilt = admin(url, "POST", "/host/resize", json={"pool_bytes": "4MiB"})
    assert rebuilt.status_code == 200, rebuilt.text
    assert rebuilt.json()["new_pages"] * rebuilt.json()["page_bytes"] <= 4 << 20
    prompt = "Pages move between device, host, disk and remote tiers. " * 3
    complete(url, prompt)
    assert complete(url, prompt)["prompt_tokens_details"]["cached_tokens"] > 0
    assert admin(url, "GET", "/bindings").json()["lags"] == []
    too_big = admin(url, "POST", "/host/resize", json={"pool_bytes": "1TiB"})
    assert too_big.status_code == 409 and "pinned budget" in too_big.json()["error"]["message"]


def test_store_passwords_never_leave_the_server(server):
    _, url = server
    port = free_port()
    secret = "s3cr3t-" + uuid.uuid4().hex
    redis_url = f"redis://:{secret}@127.0.0.1:{port}/0?require_server=false&timeout_s=0.2"
    attached = admin(url, "PUT", "/storage", json={"tier": "remote", "url": redis_url})
    assert attached.status_code == 200, attached.text
    try:
        listing = admin(url, "GET", "/storage")
        remote = listing.json()["stores"][1]
        assert remote["url"].startswith("redis://:***@127.0.0.1") and not remote["healthy"]
        for text in (attached.text, listing.text, admin(url, "GET", "/stats").text,
                     admin(url, "GET", "/bindings").text, httpx.get(url + "/metrics").text):
            assert secret not in text
    finally:
        assert admin(url, "DELETE", "/storage", params={"tier": "remote"}).status_code == 200


@pytest.mark.parametrize(("method", "path", "kw", "words"), [
    ("PUT", "/storage", {"json": {"tier": "tape", "url": "memory://x"}}, "tier"),
    ("PUT", "/storage", {"json": {"tier": "disk", "url": "memory://x", "max_bytes": "lots"}},
     "not a byte count"),
    ("PUT", "/storage", {"json": {"tier": "disk", "url": "memory://x", "color": 1}}, "color"),
    ("PUT", "/storage", {"json": {"tier": "remote", "url": "ftp://x"}}, "takes redis"),
    ("POST", "/storage/resize", {"json": {"tier": "disk", "max_bytes": 0}}, "at least 1 byte"),
    ("DELETE", "/storage", {}, "tier"),
    ("POST", "/host/resize", {"json": {"pool_bytes": 3}}, "holds no page"),
])
def test_bad_admin_requests_get_400_naming_the_problem(server, method, path, kw, words):
    resp = admin(server[1], method, path, **kw)
    assert resp.status_code == 400, resp.text
    assert words in resp.json()["error"]["message"]


def test_storage_routes_answer_409_when_the_cache_is_off():
    config = make_config(cache__enabled="false", server__admin_key=KEY)
    with running_server(config) as (_, url):
        resp = admin(url, "GET", "/storage")
        assert resp.status_code == 409 and "cache is off" in resp.json()["error"]["message"]
        assert admin(url, "GET", "/stats").json()["cache"] is None
