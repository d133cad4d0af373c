"""Where a Redis page store sends its commands: one server, or the primaries of a Redis Cluster.

Owns ``StandaloneRouter`` and ``ClusterRouter`` (split a batch of keys per server, an
``Endpoint``: by hash slot in a cluster, refreshing the slot map in the background after a MOVED
reply) and ``open_router`` (builds either from the parsed URL). redis-py is imported here, lazily,
only when a Redis store is opened. Called from the IO worker threads that call the store; the
topology refresh runs on a short-lived daemon thread that catches everything (as does each
endpoint's prober while its breaker is open).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.store.redis.breaker import CircuitBreaker
from kvtier.store.redis.endpoint import CONNECT_SHARE, HANDSHAKE_REPLY_SHARE, Endpoint
from kvtier.store.redis.options import RedisOptions

log = logging.getLogger(__name__)

class StandaloneRouter:
    """Every key goes to the one server."""

    def __init__(self, endpoint: Endpoint) -> None:
        self._endpoint = endpoint

    def route(self, rkeys: Sequence[bytes]) -> list[tuple[Endpoint | None, list[int]]]:
        return [(self._endpoint, list(range(len(rkeys))))] if rkeys else []

    def endpoints(self) -> list[Endpoint]:
        return [self._endpoint]

    def moved(self) -> None:
        """A MOVED reply from a standalone server: nothing to refresh."""

    def close(self) -> None:
        self._endpoint.close()


class ClusterRouter:
    """Keys go to the primary that owns their hash slot; batches split per primary."""

    def __init__(self, client: Any, make_endpoint: Callable[[str, Any], Endpoint]) -> None:
        self._client = client
        self._make_endpoint = make_endpoint  # (name, connection pool) -> Endpoint
        self._endpoints: dict[str, Endpoint] = {}
        self._lock = threading.Lock()
        self._refreshing = False

    def route(self, rkeys: Sequence[bytes]) -> list[tuple[Endpoint | None, list[int]]]:
        from redis.exceptions import SlotNotCoveredError

        groups: dict[str, tuple[Any, list[int]]] = {}
        unrouted: list[int] = []
        for i, rkey in enumerate(rkeys):
            try:
                node = self._client.get_node_from_key(rkey)
            except SlotNotCoveredError:
                unrouted.append(i)
                continue
            groups.setdefault(node.name, (node, []))[1].append(i)
        routed: list[tuple[Endpoint | None, list[int]]] = [
            (self._endpoint(node), idx) for node, idx in groups.values()]
        if unrouted:
            self.moved()
            routed.append((None, unrouted))
        return routed

    def _endpoint(self, node: Any) -> Endpoint:
        endpoint = self._endpoints.get(node.name)
        if endpoint is None:
            with self._lock:
                endpoint = self._endpoints.get(node.name)
                if endpoint is None:
                    pool = self._client.get_redis_connection(node).connection_pool
                    endpoint = self._make_endpoint(node.name, pool)
                    self._endpoints[node.name] = endpoint
        return endpoint

    def endpoints(self) -> list[Endpoint]:
        return [self._endpoint(node) for node in self._client.get_primaries()]

    def moved(self) -> None:
        """Refresh the slot map on a daemon thread (once at a time); calls never wait for it."""
        with self._lock:
            if self._refreshing:
                return
            self._refreshing = True
        threading.Thread(target=self._refresh, name="kvtier-redis-topology", daemon=True).start()

    def _refresh(self) -> None:
        try:
            self._client.nodes_manager.initialize()
        except Exception as exc:  # the old map stays; the next MOVED tries again
            log.warning("redis cluster: slot map refresh failed: %s", exc)
        finally:
            with self._lock:
                self._refreshing = False

    def close(self) -> None:
        with self._lock:
            endpoints = list(self._endpoints.values())
        for endpoint in endpoints:
            endpoint.close()
        self._client.close()


def _client_kwargs(opts: RedisOptions) -> dict[str, object]:
    from redis.backoff import NoBackoff
    from redis.connection import Connection
    from redis.retry import Retry

    # Handshakes (AUTH, SELECT) use socket_timeout; every data call sets its own deadline.
    # RESP2: the reader in ``wire`` speaks it (redis-py 8 would otherwise say HELLO 3).
    kwargs: dict[str, Any] = {
        "protocol": 2, "socket_timeout": opts.timeout_s * HANDSHAKE_REPLY_SHARE,
        "socket_connect_timeout": min(opts.effective_connect_timeout_s,
                                      opts.timeout_s * CONNECT_SHARE),
        "socket_keepalive": True, "max_connections": opts.max_connections,
        "retry": Retry(NoBackoff(), 0), "health_check_interval": 0}
    # No CLIENT SETINFO round trips on connect (the keyword changed across redis-py versions).
    try:
        build: Callable[..., object] = Connection  # redis-py leaves its __init__ untyped
        build(driver_info=None)  # builds the object only; connects on first use
        kwargs["driver_info"] = None
    except TypeError:
        kwargs.update(lib_name=None, lib_version=None)
    return kwargs


def open_router(client_url: str, opts: RedisOptions) -> StandaloneRouter | ClusterRouter:
    """Connection pools (not yet connected, except a cluster's slot-map discovery)."""
    import redis
    from redis.cluster import RedisCluster

    def make_endpoint(name: str, pool: Any) -> Endpoint:
        breaker = CircuitBreaker(failures=opts.breaker_failures, backoff_s=opts.breaker_backoff_s,
                                 max_backoff_s=opts.breaker_max_backoff_s)
        return Endpoint(name, pool, breaker, probe_timeout_s=opts.timeout_s)

    kwargs = _client_kwargs(opts)
    if opts.cluster:
        client = RedisCluster.from_url(client_url, require_full_coverage=False, **kwargs)
        return ClusterRouter(client, make_endpoint)
    pool = redis.ConnectionPool.from_url(client_url, **kwargs)
    conn_kwargs = pool.connection_kwargs
    name = f"{conn_kwargs.get('host', '?')}:{conn_kwargs.get('port', '?')}"
    return StandaloneRouter(make_endpoint(name, pool))
