"""The Redis store under outages: a stopped, stalled (SIGSTOP) or restarting redis-server.

Every call must come back within the configured deadline as misses / refused writes, counted,
with no exception; the circuit breaker must make calls to a dead server nearly free; the store
must reconnect by itself when the server is back; worker threads must never die.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import StoreUnavailable
from kvtier.store import open_store
from kvtier.store.redis import RedisStore
from redis_server import RedisServer, free_port, needs_redis, running_server
from store_contract import key_for, page_bytes_for

pytestmark = [needs_redis, pytest.mark.redis]

PAGE = 64 << 10
DEADLINE = 0.4
SLACK = 0.6  # scheduling noise on a loaded 2-core machine


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with running_server(tmp_path / "redis") as srv:
        yield srv


def open_redis(url: str, **options: object) -> RedisStore:
    options = {"timeout_s": DEADLINE, "breaker_backoff_s": 0.3, "breaker_max_backoff_s": 0.6,
               "breaker_failures": 2, **options}
    store = open_store(url, page_bytes=PAGE, **options)
    assert isinstance(store, RedisStore)
    return store


def pages(indexes: list[int]) -> list[bytes]:
    return [page_bytes_for(i, PAGE) for i in indexes]


def timed(fn, *args):  # -> (seconds, result)
    start = time.monotonic()
    result = fn(*args)
    return time.monotonic() - start, result


def every_call(store: RedisStore, keys: list[bytes]) -> dict[str, tuple[float, object]]:
    buffers = [np.zeros(PAGE, np.uint8) for _ in keys]
    return {"read": timed(store.read_into, keys, buffers),
            "write": timed(store.write, keys, pages(list(range(len(keys))))),
            "contains": timed(store.contains, keys),
            "delete": timed(store.delete, keys),
            "stats": timed(store.stats)}


def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_stopped_server_answers_misses_and_refusals_within_the_deadline(server: RedisServer) -> None:
    keys = [key_for(i) for i in range(4)]
    with open_redis(server.url()) as store:
        assert store.write(keys, pages(list(range(4)))) == [True] * 4
        before = store.stats()
        server.stop()
        for _ in range(3):
            results = every_call(store, keys)
            assert all(seconds < DEADLINE + SLACK for seconds, _ in results.values()), results
            assert results["read"][1] == [False] * 4
            assert results["write"][1] == [False] * 4
            assert results["contains"][1] == [False] * 4
            assert results["delete"][1] == 0
        after = store.stats()
    assert after.misses - before.misses == 12
    assert after.refused - before.refused == 12
    assert after.errors - before.errors >= 24  # read and write pages, plus contains/delete


def test_open_breaker_makes_calls_to_a_stalled_server_nearly_free(server: RedisServer) -> None:
    keys = [key_for(i) for i in range(8)]
    buffers = [np.zeros(PAGE, np.uint8) for _ in keys]
    with open_redis(server.url(), breaker_backoff_s=30, breaker_max_backoff_s=60) as store:
        server.pause()  # connections still open at the kernel, but every answer times out
        try:
            store.read_into(keys, buffers)
            store.read_into(keys, buffers)  # the second failure opens the breaker
            seconds, _ = timed(lambda: [store.read_into(keys, buffers) for _ in range(100)])
        finally:
            server.resume()
        assert seconds < 0.5, f"100 reads against an open breaker took {seconds:.3f}s"
        assert store.server_info()[0]["breaker"] == "open"
        assert store.stats().misses == 102 * 8


def test_stalled_server_calls_return_within_the_deadline(server: RedisServer) -> None:
    keys = [key_for(i) for i in range(64)]  # 4 MiB per batch: more than the socket buffers hold
    with open_redis(server.url()) as store:
        assert all(store.write(keys, pages(list(range(64)))))
        server.pause()
        try:
            results = every_call(store, keys)
        finally:
            server.resume()
        assert all(seconds < DEADLINE + SLACK for seconds, _ in results.values()), results
        assert results["read"][1] == [False] * 64 and results["write"][1] == [False] * 64
        # Back to normal after the breaker's backoff, on fresh connections.
        buffers = [np.zeros(PAGE, np.uint8) for _ in keys[:2]]
        assert wait_until(lambda: store.read_into(keys[:2], buffers) == [True, True])
        assert [b.tobytes() for b in buffers] == pages([0, 1])


def test_store_reconnects_by_itself_after_a_restart(server: RedisServer) -> None:
    keys = [key_for(i) for i in range(3)]
    buffers = [np.zeros(PAGE, np.uint8) for _ in keys]
    with open_redis(server.url()) as store:
        assert store.write(keys, pages([0, 1, 2])) == [True] * 3
        server.restart()  # no persistence: the pages are gone, the pooled connections stale
        assert store.read_into(keys, buffers) == [False] * 3
        assert store.write(keys, pages([0, 1, 2])) == [True] * 3
        assert store.read_into(keys, buffers) == [True] * 3
        assert [b.tobytes() for b in buffers] == pages([0, 1, 2])


def test_store_recovers_when_a_dead_server_comes_back(server: RedisServer) -> None:
    keys = [key_for(i) for i in range(2)]
    with open_redis(server.url()) as store:
        server.stop()
        for _ in range(3):
            assert store.write(keys, pages([0, 1])) == [False, False]
        assert store.server_info()[0]["breaker"] == "open"
        server.start()
        assert wait_until(lambda: store.write(keys, pages([0, 1])) == [True, True])
        assert store.contains(keys) == [True, True]


def test_worker_threads_survive_an_outage_and_recover(server: RedisServer) -> None:
    store = open_redis(server.url())
    stop = threading.Event()
    failures: list[BaseException] = []
    slowest = [0.0]

    def worker(n: int) -> None:
        keys = [key_for(100 * n + i) for i in range(4)]
        buffers = [np.zeros(PAGE, np.uint8) for _ in keys]
        data = pages([100 * n + i for i in range(4)])
        try:
            while not stop.is_set():
                for call in (lambda: store.write(keys, data), lambda: store.read_into(keys, buffers),
                             lambda: store.contains(keys)):
                    seconds, _ = timed(call)
                    slowest[0] = max(slowest[0], seconds)
        except BaseException as exc:  # reported on the test thread
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(3)]
    for th in threads:
        th.start()
    try:
        time.sleep(0.3)
        server.stop()
        time.sleep(0.8)
        server.start()
        keys = [key_for(9000)]
        assert wait_until(lambda: store.write(keys, pages([9000])) == [True])
    finally:
        stop.set()
        for th in threads:
            th.join()
        store.close()
    assert not failures, failures
    assert all(th.is_alive() is False for th in threads)
    assert slowest[0] < DEADLINE + SLACK


def test_unreachable_server_at_open_raises_store_unavailable() -> None:
    port = free_port()
    seconds, _ = timed(lambda: pytest.raises(StoreUnavailable, open_redis,
                                             f"redis://127.0.0.1:{port}/0"))
    assert seconds < DEADLINE + SLACK


def test_store_opened_offline_connects_once_the_server_starts(tmp_path: Path) -> None:
    port = free_port()
    store = open_redis(f"redis://127.0.0.1:{port}/0", require_server=False)
    try:
        keys = [key_for(1)]
        assert store.write(keys, pages([1])) == [False]
        with running_server(tmp_path / "late", port=port):
            assert wait_until(lambda: store.write(keys, pages([1])) == [True])
            buffers = [np.zeros(PAGE, np.uint8)]
            assert store.read_into(keys, buffers) == [True]
            assert buffers[0].tobytes() == pages([1])[0]
    finally:
        store.close()


def breaker_of(store: RedisStore):  # the one server's breaker, read without calling it
    return store._router.endpoints()[0].breaker


def probers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvtier-redis-probe")]


def test_calls_during_a_long_stall_all_answer_at_once(server: RedisServer) -> None:
    """A stalled server (every answer times out) for 2 s, across several probe rounds: once
    the breaker is open no call waits for the server; the probing happens elsewhere."""
    keys = [key_for(i) for i in range(4)]
    buffers = [np.zeros(PAGE, np.uint8) for _ in keys]
    with open_redis(server.url()) as store:
        assert all(store.write(keys, pages(list(range(4)))))
        server.pause()
        try:
            for _ in range(2):  # breaker_failures: these two wait out the deadline
                store.read_into(keys, buffers)
            assert breaker_of(store).is_open
            slowest, calls, end = 0.0, 0, time.monotonic() + 2.0
            while time.monotonic() < end:
                seconds, found = timed(store.read_into, keys, buffers)
                assert found == [False] * 4
                slowest, calls = max(slowest, seconds), calls + 1
                time.sleep(0.01)
            assert breaker_of(store).stats().opened >= 3  # probes failed meanwhile
        finally:
            server.resume()
        assert slowest < 0.1, f"a call took {slowest:.3f}s while the breaker was open"
        assert wait_until(lambda: not breaker_of(store).is_open)
        assert store.read_into(keys, buffers) == [True] * 4
    assert not probers()


def test_the_store_serves_again_within_one_backoff_of_the_server_returning(
        server: RedisServer) -> None:
    """Down for 2 s with nobody calling: once the server answers again, the breaker closes
    within the capped backoff (0.6 s here, +20% jitter) plus one probe, by itself."""
    keys = [key_for(i) for i in range(2)]
    with open_redis(server.url()) as store:
        server.stop()
        for _ in range(2):
            assert store.write(keys, pages([0, 1])) == [False, False]
        assert breaker_of(store).is_open
        time.sleep(2.0)
        server.start()  # returns once the server answers PING
        back = time.monotonic()
        assert wait_until(lambda: not breaker_of(store).is_open, timeout_s=5.0)
        recovered_s = time.monotonic() - back
        assert recovered_s < 0.6 * 1.2 + DEADLINE + SLACK, recovered_s
        assert store.write(keys, pages([0, 1])) == [True, True]
        assert wait_until(lambda: not probers())  # the prober leaves once the breaker closes
    assert not probers()
