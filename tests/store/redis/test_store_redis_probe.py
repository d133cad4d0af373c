"""The Redis store's health probe on a real redis-server: pages lost after a restart empty or a
flush (its run marker changed), not after a mere reconnect; unreachable while the server is down;
and a store guard that starts off while the server is down and comes in once it answers."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.store import open_store
from kvtier.store.guard import GuardSettings, StoreGuard
from kvtier.store.redis import RedisStore
from redis_server import RedisServer, needs_redis, running_server
from store_contract import key_for, page_bytes_for

pytestmark = [needs_redis, pytest.mark.redis]

PAGE = 4096
OPTIONS = {"timeout_s": 0.4, "breaker_backoff_s": 0.1, "breaker_max_backoff_s": 0.2,
           "breaker_failures": 1}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with running_server(tmp_path / "redis") as srv:
        yield srv


def open_redis(url: str) -> RedisStore:
    store = open_store(url, page_bytes=PAGE, **OPTIONS)
    assert isinstance(store, RedisStore)
    return store


def probe_until(store: RedisStore, want: bool, timeout_s: float = 5.0) -> bool:
    """Probe until ``lost`` is ``want`` (a restarted server may first read as unreachable)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        probe = store.probe()
        if not probe.problem and probe.lost == want:
            return True
        time.sleep(0.05)
    return False


def test_a_restart_empty_reads_as_lost_once_and_a_reconnect_does_not(server) -> None:
    with open_redis(server.url()) as store:
        store.write([key_for(0)], [page_bytes_for(0, PAGE)])
        assert [store.probe().lost for _ in range(3)] == [False] * 3
        with server.client() as raw:
            raw.client_kill_filter(_type="normal", skipme=True)  # drop our connections only
        assert store.probe().lost is False
        server.restart()
        assert probe_until(store, True)
        assert store.probe().lost is False  # said once, then the new run is the baseline


def test_a_flush_reads_as_lost(server) -> None:
    with open_redis(server.url()) as store, server.client() as raw:
        raw.flushall()
        probe = store.probe()
        assert probe.lost and not probe.problem


def test_a_second_store_on_the_same_server_sees_the_same_run(server) -> None:
    with open_redis(server.url()) as one, open_redis(server.url()) as two:
        assert not one.probe().lost and not two.probe().lost
        server.restart()
        assert probe_until(one, True) and probe_until(two, True)
        assert not one.probe().lost and not two.probe().lost


def test_the_probe_says_unreachable_while_the_server_is_down(server) -> None:
    with open_redis(server.url()) as store:
        server.stop()
        probe = store.probe()
        assert probe.reason == "unreachable" and "unreachable" in probe.problem


def test_a_guard_over_a_server_down_at_start_serves_off_then_brings_it_in(tmp_path) -> None:
    server = RedisServer(tmp_path / "redis")
    settings = GuardSettings(check_interval_s=0.05, retry_first_s=0.05, retry_max_s=0.2)
    opener = functools.partial(open_redis, server.url())
    with StoreGuard.open("remote", opener, page_bytes=PAGE, scheme="redis", url=server.url(),
                         settings=settings) as guard:
        health = guard.health()
        assert health["state"] == "off" and list(health["problems"]) == ["unavailable"]
        assert guard.write([key_for(1)], [page_bytes_for(1, PAGE)]) == [False]
        server.start()
        try:
            deadline = time.monotonic() + 5.0
            while not guard.available and time.monotonic() < deadline:
                time.sleep(0.02)
            assert guard.health()["state"] == "on"
            assert guard.write([key_for(1)], [page_bytes_for(1, PAGE)]) == [True]
        finally:
            server.stop()
