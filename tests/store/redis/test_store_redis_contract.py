"""The ``redis://`` store passes the shared store contract against real redis-server processes.

One standalone server per module and one 3-node Redis Cluster (keys spread over the nodes by hash
slot). Each store gets its own key prefix, so stores sharing a server start empty and "reopen"
(a new store on the same prefix) sees the same pages, like any persistent backend. Page counts
are not exact here (``stats().pages`` counts the whole database), so the contract skips them;
``test_store_redis_features`` checks the exact SCAN count on its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.store import open_store
from kvtier.store.base import PageStore
from kvtier.store.redis import RedisStore
from redis_server import (
    REDIS_CLI,
    RedisClusterNodes,
    RedisServer,
    needs_redis,
    running_cluster,
    running_server,
)
from store_contract import StoreContract

pytestmark = [needs_redis, pytest.mark.redis]
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_server(tmp_path_factory.mktemp("redis-contract")) as server:
        yield server


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    if REDIS_CLI is None:
        pytest.skip("redis-cli (redis-tools) is not installed")
    with running_cluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


class RedisContract(StoreContract):
    persistent = True
    exact_page_count = False
    url = ""

    def make_store(self, tmp_path: Path, page_bytes: int) -> PageStore:
        prefix = f"contract{next(_prefixes)}:"
        sep = "&" if "?" in self.url else "?"
        store = open_store(f"{self.url}{sep}prefix={prefix}", page_bytes=page_bytes)
        assert isinstance(store, RedisStore)
        return store

    def reopen(self, store: PageStore) -> PageStore:
        assert isinstance(store, RedisStore)
        store.close()
        sep = "&" if "?" in self.url else "?"
        return open_store(f"{self.url}{sep}prefix={store.options.prefix}", page_bytes=store.page_bytes)


class TestRedisStore(RedisContract):
    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer) -> None:
        self.url = redis_server.url()


class TestRedisClusterStore(RedisContract):
    # Routing is what the cluster adds; the single-server run above covers the model deeply.
    machine_examples = 5
    machine_steps = 15

    @pytest.fixture(autouse=True)
    def _cluster(self, redis_cluster: RedisClusterNodes) -> None:
        self.url = redis_cluster.url()
