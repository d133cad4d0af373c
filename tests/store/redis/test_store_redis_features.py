"""What the Redis store does beyond the shared contract: verification of stored values, key
namespaces, TTL, server memory and eviction stats, large pages over several round trips,
sharing between two processes, options, and routing over a 3-node Redis Cluster."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.store import open_store
from kvtier.store.record import encode_header
from kvtier.store.redis import RedisStore
from redis_server import REDIS_CLI, RedisServer, needs_redis, running_cluster, running_server
from store_contract import key_for, page_bytes_for

pytestmark = [needs_redis, pytest.mark.redis]

PAGE = 4099
SRC = str(Path(__file__).resolve().parents[3] / "src")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_server(tmp_path_factory.mktemp("redis-features")) as srv:
        yield srv


def open_redis(url: str, page_bytes: int = PAGE, **options: object) -> RedisStore:
    store = open_store(url, page_bytes=page_bytes, **options)
    assert isinstance(store, RedisStore)
    return store


def read(store: RedisStore, indexes: list[int], page_bytes: int = PAGE) -> list[bytes | None]:
    buffers = [np.zeros(page_bytes, np.uint8) for _ in indexes]
    found = store.read_into([key_for(i) for i in indexes], buffers)
    return [b.tobytes() if ok else None for ok, b in zip(found, buffers, strict=True)]


def rkey(prefix: str, i: int) -> bytes:
    return prefix.encode() + key_for(i).hex().encode()


# ---- values are verified ------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncated", "flipped", "foreign", "not_a_record", "wrong_type"])
def test_damaged_value_is_a_counted_corrupt_miss_once_then_stored_again(
        server: RedisServer, damage: str) -> None:
    prefix = f"damage-{damage}:"
    with open_redis(server.url(), prefix=prefix) as store, server.client() as raw:
        store.write([key_for(1), key_for(2)], [page_bytes_for(1, PAGE), page_bytes_for(2, PAGE)])
        value = raw.get(rkey(prefix, 1))
        if damage == "truncated":
            raw.set(rkey(prefix, 1), value[:-10])
        elif damage == "flipped":
            raw.setrange(rkey(prefix, 1), 64 + 100, bytes([value[164] ^ 1]))
        elif damage == "foreign":  # another key's intact record
            raw.set(rkey(prefix, 1), raw.get(rkey(prefix, 2)))
        elif damage == "not_a_record":
            raw.set(rkey(prefix, 1), os.urandom(len(value)))
        else:
            raw.delete(rkey(prefix, 1))
            raw.lpush(rkey(prefix, 1), b"x")
        before = store.stats()
        assert read(store, [1, 2]) == [None, page_bytes_for(2, PAGE)]
        after = store.stats()
        # the damaged value is gone: no longer promised, and the next write stores a good copy
        assert store.contains([key_for(1), key_for(2)]) == [False, True]
        assert store.write([key_for(1)], [page_bytes_for(1, PAGE)]) == [True]
        assert read(store, [1, 2]) == [page_bytes_for(1, PAGE), page_bytes_for(2, PAGE)]
    assert (after.corrupt - before.corrupt, after.misses - before.misses) == (1, 1)
    assert after.dropped - before.dropped == 1


def test_values_carry_the_record_header_and_keys_the_prefix(server: RedisServer) -> None:
    page = page_bytes_for(3, PAGE)
    with open_redis(server.url(), prefix="layout:") as store, server.client() as raw:
        store.write([key_for(3)], [page])
        assert raw.get(rkey("layout:", 3)) == encode_header(key_for(3), page) + page


def test_prefixes_keep_namespaces_apart(server: RedisServer) -> None:
    with open_redis(server.url(), prefix="ns-a:") as a, open_redis(server.url(), prefix="ns-b:") as b:
        a.write([key_for(0)], [page_bytes_for(0, PAGE)])
        assert b.contains([key_for(0)]) == [False]
        assert read(b, [0]) == [None]
        assert read(a, [0]) == [page_bytes_for(0, PAGE)]


def test_ttl_sets_an_expiry_on_written_pages(server: RedisServer) -> None:
    with open_redis(server.url(), prefix="ttl:", ttl_s=120) as store, server.client() as raw:
        store.write([key_for(0)], [page_bytes_for(0, PAGE)])
        assert 110_000 < raw.pttl(rkey("ttl:", 0)) <= 120_000
    with open_redis(server.url(), prefix="nottl:") as store, server.client() as raw:
        store.write([key_for(0)], [page_bytes_for(0, PAGE)])
        assert raw.pttl(rkey("nottl:", 0)) == -1


# ---- stats ----------------------------------------------------------------------------------
def test_scan_page_count_is_exact_for_the_prefix(server: RedisServer) -> None:
    with open_redis(server.url(), prefix="count:", page_count="scan") as store:
        store.write([key_for(i) for i in range(7)], [page_bytes_for(i, PAGE) for i in range(7)])
        store.delete([key_for(0)])
        stats = store.stats()
    assert stats.pages == 6 and stats.bytes > 6 * PAGE  # bytes: the server's used memory


def test_lru_eviction_is_reported_in_stats(tmp_path: Path) -> None:
    page = 64 << 10
    extra = ["--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"]
    with running_server(tmp_path / "lru", extra=extra) as srv, \
            open_redis(srv.url(), page, batch_bytes=page) as store:
        for start in range(0, 160, 16):
            batch = list(range(start, start + 16))
            assert all(store.write([key_for(i) for i in batch],
                                   [page_bytes_for(i, page) for i in batch]))
        stats = store.stats()
        info = store.server_info()[0]
        got = read(store, list(range(160)), page)
        # Redis's LRU is approximate (it samples keys): which old pages went is not fixed, but
        # the newest stays, older ones are gone, and whatever is left reads back intact
        missing = [i for i, value in enumerate(got) if value is None]
        assert got[159] == page_bytes_for(159, page)
        assert missing and min(missing) < 80
        assert all(value == page_bytes_for(i, page) for i, value in enumerate(got) if value)
        assert store.stats().corrupt == 0
    assert stats.evicted > 0 and stats.capacity_bytes == 4 << 20
    assert info["maxmemory_policy"] == "allkeys-lru"


# ---- large pages, several round trips -------------------------------------------------------
def test_large_pages_and_misses_mix_over_several_round_trips(server: RedisServer) -> None:
    page = 256 << 10
    with open_redis(server.url(), page, prefix="big:", batch_bytes=600 << 10) as store:
        written = [0, 2, 3, 5, 8, 9]
        store.write([key_for(i) for i in written], [page_bytes_for(i, page) for i in written])
        got = read(store, list(range(10)), page)
    assert got == [page_bytes_for(i, page) if i in written else None for i in range(10)]


# ---- sharing between processes --------------------------------------------------------------
_PAGES = """
import hashlib, random, sys
from kvtier.store import open_store
url, page, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
keys = [hashlib.sha256(b"kvtier-test-page-%d" % i).digest() for i in range(n)]  # key_for(i)
"""
_WRITER = _PAGES + """
with open_store(url, page_bytes=page) as store:
    pages = [random.Random(i).randbytes(page) for i in range(n)]  # page_bytes_for(i, page)
    assert all(store.write(keys, pages))
"""
_READER = _PAGES + """
with open_store(url, page_bytes=page) as store:
    buffers = [bytearray(page) for _ in range(n)]
    for ok, buf in zip(store.read_into(keys, buffers), buffers):
        print(hashlib.sha256(buf).hexdigest() if ok else "miss")
"""


def run_kvtier_process(code: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_pages_written_by_one_process_are_bit_exact_hits_in_another(server: RedisServer) -> None:
    url, page, n = server.url(query="prefix=shared:"), 65536, 12
    run_kvtier_process(_WRITER, url, str(page), str(n))
    seen = run_kvtier_process(_READER, url, str(page), str(n + 2)).split()
    expected = [hashlib.sha256(page_bytes_for(i, page)).hexdigest() for i in range(n)]
    assert seen == [*expected, "miss", "miss"]


def test_importing_the_store_registry_does_not_import_redis() -> None:
    out = run_kvtier_process("import sys, kvtier.store; print('redis' in sys.modules)")
    assert out.strip() == "False"


# ---- options ----------------------------------------------------------------------------------
@pytest.mark.parametrize("query", ["bogus=1", "timeout_s=0", "ttl_s=-1", "page_count=all",
                                   "cluster=maybe", "batch_bytes=lots"])
def test_bad_options_are_config_errors(server: RedisServer, query: str) -> None:
    with pytest.raises(ConfigError):
        open_store(server.url(query=query), page_bytes=PAGE)


def test_keyword_options_win_over_the_url_query(server: RedisServer) -> None:
    with open_redis(server.url(query="prefix=fromurl:&timeout_s=5"), prefix="kw:") as store:
        assert store.options.prefix == "kw:" and store.options.timeout_s == 5.0


# ---- Redis Cluster ----------------------------------------------------------------------------
@pytest.fixture
def cluster(tmp_path: Path):
    if REDIS_CLI is None:
        pytest.skip("redis-cli (redis-tools) is not installed")
    with running_cluster(tmp_path / "cluster") as nodes:
        yield nodes


def test_cluster_spreads_pages_and_a_dead_node_only_costs_its_own(cluster) -> None:
    keys = [key_for(i) for i in range(48)]
    pages = [page_bytes_for(i, PAGE) for i in range(48)]
    with open_redis(cluster.url(), prefix="spread:", timeout_s=0.5) as store:
        assert store.write(keys, pages) == [True] * 48
        per_node = [s.client().dbsize() for s in cluster.servers]
        assert all(count > 0 for count in per_node) and sum(per_node) == 48 + 1  # + run marker
        assert read(store, list(range(48))) == pages
        victim = cluster.servers[1]
        with victim.client() as raw:
            on_victim = {k for k in raw.keys("spread:*")}
        victim.stop()
        start = time.monotonic()
        got = read(store, list(range(48)))
        assert time.monotonic() - start < 1.5
    lost = [rkey("spread:", i) in on_victim for i in range(48)]
    assert [g is None for g in got] == lost
    assert [g for g, gone in zip(got, lost, strict=True) if not gone] == \
        [p for p, gone in zip(pages, lost, strict=True) if not gone]
