"""Options of the ``redis://`` / ``rediss://`` page store, parsed from the URL and keyword options.

Owns ``RedisOptions`` (a frozen dataclass: namespace prefix, TTL, deadline, breaker, pool and
batching settings) and ``parse_redis_url``, which splits a store URL into kvtier's options and the
URL that redis-py gets (credentials, host, port, db and TLS settings stay in it). Pure Python;
called once, on the thread that opens the store.

Examples::

    redis://127.0.0.1:6379/0?prefix=llama3:&ttl_s=86400
    redis://kvtier:secret@cache.internal:6379/2?timeout_s=0.5
    rediss://:secret@cache.internal:6380/0?ssl_ca_certs=/etc/ssl/ca.pem
    redis://10.0.0.5:7000?cluster=true
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any, SupportsFloat, SupportsIndex
from urllib.parse import urlencode, urlsplit, urlunsplit

from kvtier.errors import ConfigError
from kvtier.units import parse_size

#: Query parameters handed to redis-py untouched (TLS material, client name, database).
PASSTHROUGH = frozenset({
    "db", "client_name", "ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path", "ssl_ca_data",
    "ssl_certfile", "ssl_keyfile", "ssl_password", "ssl_check_hostname", "ssl_min_version",
})

PAGE_COUNT_MODES = ("dbsize", "scan")


@dataclass(frozen=True)
class RedisOptions:
    """kvtier's settings of one Redis store (all optional; the defaults suit one LAN Redis)."""

    prefix: str = "kvtier:"          # key namespace: every key is prefix + hex(page key)
    ttl_s: int = 0                   # expiry of written pages, seconds (0: none, rely on LRU)
    timeout_s: float = 1.0           # deadline of every call (miss / refused write past it)
    connect_timeout_s: float = 0.0   # TCP connect timeout, at most timeout_s / 4 (0: that)
    max_connections: int = 64        # connections per server in the pool
    batch_bytes: int = 8 << 20       # bytes of pages per pipelined round trip
    cluster: bool = False            # talk Redis Cluster (keys routed by hash slot)
    breaker_failures: int = 3        # consecutive failed calls that open the breaker
    breaker_backoff_s: float = 0.5   # first open period; doubles per failed probe
    breaker_max_backoff_s: float = 2.0  # the cap: back in service <= 1.2x this after the server
    page_count: str = "dbsize"       # stats().pages: DBSIZE, or an exact SCAN of the prefix
    require_server: bool = True      # raise at open when the server is unreachable

    @property
    def effective_connect_timeout_s(self) -> float:
        """The TCP connect timeout asked for (capped by the store at a quarter of timeout_s)."""
        return self.connect_timeout_s if self.connect_timeout_s > 0 else self.timeout_s


def _coerce(name: str, kind: type, raw: object) -> object:
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(name, raw, "true or false")
    if kind is int:
        value = raw if isinstance(raw, int) and not isinstance(raw, bool) else parse_size(str(raw))
        if value is None:
            raise ConfigError(name, raw, "an integer (sizes such as 8MiB allowed)")
        return int(value)
    if kind is float:
        try:
            if not isinstance(raw, (str, bytes, SupportsFloat, SupportsIndex)):
                raise TypeError(type(raw).__name__)
            return float(raw)
        except (TypeError, ValueError):
            raise ConfigError(name, raw, "a number") from None
    return str(raw)


def _check(opts: RedisOptions) -> RedisOptions:
    if not 0 < opts.timeout_s <= 60:
        raise ConfigError("timeout_s", opts.timeout_s, "a deadline from 0 to 60 seconds")
    if opts.ttl_s < 0:
        raise ConfigError("ttl_s", opts.ttl_s, "0 (no expiry) or more seconds")
    if opts.max_connections < 1:
        raise ConfigError("max_connections", opts.max_connections, "at least 1")
    if opts.batch_bytes < 1:
        raise ConfigError("batch_bytes", opts.batch_bytes, "at least 1 byte")
    if opts.breaker_failures < 1:
        raise ConfigError("breaker_failures", opts.breaker_failures, "at least 1")
    if not 0 < opts.breaker_backoff_s <= opts.breaker_max_backoff_s:
        raise ConfigError("breaker_backoff_s", opts.breaker_backoff_s,
                          "more than 0 and at most breaker_max_backoff_s")
    if opts.page_count not in PAGE_COUNT_MODES:
        raise ConfigError("page_count", opts.page_count, "one of " + ", ".join(PAGE_COUNT_MODES))
    if any(c in opts.prefix for c in "{}") and opts.cluster:
        raise ConfigError("prefix", opts.prefix, "no braces in cluster mode (they pin one slot)")
    return opts


def parse_redis_url(url: str, options: dict[str, object]) -> tuple[str, RedisOptions]:
    """(URL for redis-py, kvtier options) from a store URL and the merged query/keyword options."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ConfigError("store url", url, "a redis:// or rediss:// URL")
    if not parts.hostname:
        raise ConfigError("store url", parts.scheme + "://...", "a URL naming a host")
    kinds = {f.name: type(f.default) for f in fields(RedisOptions)}
    chosen: dict[str, Any] = {}
    passthrough: dict[str, str] = {}
    for name, raw in options.items():
        if name in kinds:
            chosen[name] = _coerce(name, kinds[name], raw)
        elif name in PASSTHROUGH:
            passthrough[name] = str(raw)
        else:
            allowed = ", ".join(sorted([*kinds, *PASSTHROUGH]))
            raise ConfigError("redis store option", name, allowed)
    opts = _check(dataclasses.replace(RedisOptions(), **chosen))
    client_url = urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(passthrough), ""))
    return client_url, opts
