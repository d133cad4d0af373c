"""A cache built from a config whose stores are broken still builds and serves (``TieredCache.build``
is what ``kvtier serve`` and the vLLM and SGLang plug-ins call): a foreign disk directory leaves
the disk tier off, an unreachable Redis leaves the remote tier off until it answers, and a Redis
restarted empty is noticed by its run marker, so the cache forgets what it believed the server
held at once and writes those pages again on the next pass. Real files, a real redis-server."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cache_support import LAYOUT, NAMESPACE, P, prompt, serve
from kvtier.cache import TieredCache
from kvtier.config import build_config
from kvtier.store import open_store
from kvtier.store.guard import StoreGuard
from redis_server import RedisServer, needs_redis, running_server

PAGES = 6


def build(**flags: Any) -> TieredCache:
    base: dict[str, Any] = {"cache.page_size": P, "cache.device_pages": 64,
                            "host.pool_bytes": 128 * LAYOUT.page_bytes,
                            "controller.min_prefetch_tokens": 0, "controller.io_workers": 2,
                            "store.disk_min_free_bytes": 0, "store.remote_timeout_s": 0.5}
    config = build_config(env={}, flags={**base, **flags})
    return TieredCache.build(config, LAYOUT, NAMESPACE)


def guard(cache: TieredCache, tier: str) -> StoreGuard:
    store = cache.store(tier)
    assert isinstance(store, StoreGuard)
    return store


def serve_all(cache: TieredCache, prompts: list[list[int]]) -> None:
    for tokens in prompts:
        serve(cache, tokens)
    assert cache.drain(10.0)


def wait_for(condition: Any, what: str, timeout_s: float = 8.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.05)


def test_a_foreign_disk_directory_leaves_the_disk_tier_off_and_the_cache_serving(
        tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    with open_store(f"file://{disk}", page_bytes=2 * LAYOUT.page_bytes):
        pass  # another model's store: pages of another size
    with build(**{"store.disk_url": f"file://{disk}"}) as cache:
        health = cache.store_health()["disk"]
        assert health["state"] == "off" and "foreign" in health["problems"]  # type: ignore[operator]
        tokens = prompt(PAGES, seed=1)
        serve_all(cache, [tokens])
        hit, _ = serve(cache, tokens)
        assert hit.tokens == PAGES * P  # served from the device tier
        counters = cache.stats()["counters"]
        assert "disk" not in counters.get("backup_total", {})  # type: ignore[union-attr]
        cache.check_integrity()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with running_server(tmp_path / "redis") as server:
        yield server


@needs_redis
def test_an_unreachable_redis_at_start_leaves_the_remote_tier_off_until_it_answers(
        tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")  # not started yet
    with build(**{"store.remote_url": server.url()}) as cache:
        remote = guard(cache, "remote")
        assert remote.health()["state"] == "off" and not remote.available
        first = prompt(PAGES, seed=2)
        serve_all(cache, [first])
        assert cache.index.sizes("remote").resident == 0
        assert "remote" not in cache.stats()["counters"].get("backup_total", {})  # type: ignore[union-attr]
        server.start()
        try:
            remote.supervisor.tick(reopen_now=True)
            assert remote.health()["state"] == "on"
            serve_all(cache, [prompt(PAGES, seed=3)])
            with server.client() as raw:
                assert raw.dbsize() >= PAGES
        finally:
            server.stop()


@needs_redis
def test_a_redis_restarted_empty_is_forgotten_at_once_and_filled_again_in_one_pass(
        redis_server: RedisServer) -> None:
    prompts = [prompt(PAGES, seed=10 + i) for i in range(3)]
    with build(**{"store.remote_url": redis_server.url()}) as cache:
        serve_all(cache, prompts)
        assert cache.index.sizes("remote").resident == 3 * PAGES
        remote = guard(cache, "remote")
        epoch = remote.epoch
        redis_server.restart()  # no persistence: it comes back empty

        def noticed() -> bool:
            remote.supervisor.tick()
            cache.poll()
            return cache.index.sizes("remote").resident == 0

        wait_for(noticed, "the cache forgot the remote pages")
        assert remote.epoch > epoch and remote.health()["events_total"]["lost"] >= 1
        assert cache.stats()["counters"]["store_lost_total"] == {"remote": 1}  # type: ignore[index]
        cache.flush()
        serve_all(cache, prompts)  # one pass writes them again ...
        with redis_server.client() as raw:
            assert raw.dbsize() >= 3 * PAGES
        cache.flush()
        hit = cache.match(prompts[0])  # ... and the next one finds them there
        assert hit.tokens_by_tier["remote"] == PAGES * P
