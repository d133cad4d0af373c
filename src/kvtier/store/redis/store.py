"""``redis://`` and ``rediss://``: the remote page store, shared by every instance on Redis or Valkey.

Owns ``RedisStore``: pages stored as Redis strings ``prefix + hex(page key)`` whose value is the
64-byte record header plus the payload (so a corrupt, truncated or foreign value reads as a
counted miss), with an optional TTL. Batches are pipelined per server (``ops``), page
payloads travel between the socket and the caller's buffers without intermediate copies
(``wire``, ``pages``), replies are judged by ``verify``, and connections,
TLS, AUTH/ACL users and Redis Cluster slot maps come from redis-py (``nodes``; imported
lazily, so ``import kvtier.store`` never needs it).

A value that fails verification is deleted after the read that rejected it, so ``contains``
stops promising it and the next write stores a good copy.

Outages are values: with Redis down, stalled or restarting, every call returns within
``timeout_s`` as misses or refused writes (counted in ``errors``), a circuit breaker per server
makes calls to a dead server cost ~nothing, and pools reconnect by themselves once it is back.
Only misuse raises (wrong buffer sizes, a closed store), and opening raises ``StoreUnavailable``
for wrong or missing credentials. Thread-safe: IO worker threads call it concurrently, each
call on its own pooled connections.
"""

from __future__ import annotations

import logging
import threading
from binascii import hexlify
from collections.abc import Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

from kvtier.errors import ConfigError, StoreUnavailable
from kvtier.keys import KEY_BYTES
from kvtier.store.base import Buffer, PageStore, Probe, StoreCounters, StoreStats
from kvtier.store.record import HEADER_BYTES
from kvtier.store.redis.channel import Deadline
from kvtier.store.redis.endpoint import MOVED_KINDS, Endpoint, EndpointDown, Work
from kvtier.store.redis.marker import RunMarker
from kvtier.store.redis.nodes import ClusterRouter, StandaloneRouter, open_router
from kvtier.store.redis.ops import Info, get_pages, glob_escape, per_key, server_info, set_pages
from kvtier.store.redis.options import RedisOptions, parse_redis_url
from kvtier.store.redis.pages import page_views
from kvtier.store.redis.verify import PageJudge, Verdicts
from kvtier.store.redis.wire import ServerError
from kvtier.units import redact_url

T = TypeVar("T")

log = logging.getLogger(__name__)

_CREDENTIAL_KINDS = frozenset({"NOAUTH", "WRONGPASS", "NOPERM"})
_EVICTING_POLICIES = frozenset({"allkeys-lru", "allkeys-lfu", "allkeys-random"})


class EvictionTally:
    """Evictions the servers reported since this store opened (survives server restarts)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, int] = {}
        self._total = 0

    def observe(self, endpoint: str, evicted_keys: int) -> None:
        with self._lock:
            last = self._last.get(endpoint)
            if last is not None:
                self._total += evicted_keys - last if evicted_keys >= last else evicted_keys
            self._last[endpoint] = evicted_keys

    @property
    def total(self) -> int:
        with self._lock:
            return self._total


class RedisStore(PageStore):
    scheme = "redis"

    def __init__(self, page_bytes: int, router: StandaloneRouter | ClusterRouter,
                 options: RedisOptions, *,
                 display_url: str = "redis://", scheme: str = "redis") -> None:
        super().__init__(page_bytes)
        self.scheme = scheme
        self.options = options
        self.url = display_url
        self._router = router
        self._prefix = options.prefix.encode()
        self._counters = StoreCounters()
        self._evictions = EvictionTally()
        self._pages_per_trip = max(1, options.batch_bytes // (page_bytes + HEADER_BYTES))
        self._judge = PageJudge(page_bytes)
        self._marker = RunMarker(self._prefix)

    @classmethod
    def from_url(cls, url: str, page_bytes: int, options: dict[str, object]) -> RedisStore:
        client_url, opts = parse_redis_url(url, dict(options))
        shown = redact_url(url)
        try:
            router = open_router(client_url, opts)
        except ImportError as exc:
            raise ConfigError("store url", shown, "the redis package installed "
                              f"(pip install 'kvtier[redis]'): {exc}") from None
        except ValueError as exc:
            raise ConfigError("store url", shown, f"settings redis-py accepts ({exc})") from None
        except Exception as exc:  # a cluster whose slot map cannot be read
            raise StoreUnavailable(f"cannot open redis store {shown}: {exc}") from None
        store = cls(page_bytes, router, opts, display_url=shown, scheme=urlsplit(url).scheme)
        try:
            store._check_servers()
        except BaseException:
            store.close()
            raise
        return store

    # ---- open-time checks ------------------------------------------------------------------
    def _check_servers(self) -> None:
        for endpoint in self._router.endpoints():
            deadline = Deadline(self.options.timeout_s)
            try:
                info = endpoint.probe(server_info(None), deadline)
            except Exception as exc:
                self._open_failure(endpoint, exc)
                continue
            self._evictions.observe(endpoint.name, int(info.get("evicted_keys", 0)))
            self._warn_about_eviction_setup(endpoint.name, info)
        try:
            self._check_marker()  # notes the run marker (and sets it on a fresh server)
        except EndpointDown:
            pass  # unreachable, and allowed to be: the first probe that reaches it notes it

    def _open_failure(self, endpoint: Endpoint, exc: Exception) -> None:
        from redis.exceptions import AuthenticationError, ResponseError

        where = f"redis store {self.url} ({endpoint.name})"
        if isinstance(exc, ServerError) and exc.kind in _CREDENTIAL_KINDS:
            reason = str(exc).rstrip(".")
            raise StoreUnavailable(f"{where} refused access: {reason}. Give the user and password "
                                   "in the URL: redis://USER:PASSWORD@host:port/db") from None
        if isinstance(exc, AuthenticationError):
            raise StoreUnavailable(f"{where} refused the credentials: {exc}") from None
        if isinstance(exc, ResponseError):  # AUTH or SELECT answered with an error
            raise StoreUnavailable(f"{where} refused the connection (credentials or db): "
                                   f"{exc}") from None
        if self.options.require_server:
            raise StoreUnavailable(f"cannot reach {where} within {self.options.timeout_s}s: "
                                   f"{type(exc).__name__}: {exc}") from None
        log.warning("%s unreachable at open (%s); pages miss until it answers", where, exc)

    @staticmethod
    def _warn_about_eviction_setup(name: str, info: Info) -> None:
        policy = info.get("maxmemory_policy", "")
        if not info.get("maxmemory"):
            log.warning("redis %s has no maxmemory: set maxmemory and maxmemory-policy "
                        "allkeys-lru so old pages are evicted", name)
        elif policy not in _EVICTING_POLICIES:
            log.warning("redis %s evicts with %r: writes fail once it is full; use allkeys-lru",
                        name, policy)

    # ---- helpers ---------------------------------------------------------------------------
    def _rkeys(self, keys: Sequence[bytes]) -> list[bytes]:
        for size in set(map(len, keys)) - {KEY_BYTES}:
            raise ValueError(f"page keys are {KEY_BYTES} bytes, got {size}")
        prefix = self._prefix
        return [prefix + hexlify(key) for key in keys]

    def _run(self, endpoint: Endpoint | None, work: Work[T], deadline: Deadline) -> T | None:
        """The work's replies, or None when the server failed (an outage, counted by callers)."""
        if endpoint is None:
            return None
        try:
            return endpoint.run(work, deadline)
        except EndpointDown as exc:
            log.debug("%s", exc)
            return None

    def _reply_problem(self, reply: ServerError) -> None:
        if reply.kind in MOVED_KINDS:
            self._router.moved()

    # ---- the contract ----------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self._check_open()
        rkeys = self._rkeys(keys)
        present = [False] * len(keys)
        deadline = Deadline(self.options.timeout_s)
        errors = 0
        for endpoint, idx in self._router.route(rkeys):
            replies = self._run(endpoint, per_key(b"EXISTS", [rkeys[i] for i in idx]), deadline)
            if replies is None:
                errors += len(idx)
                continue
            for i, reply in zip(idx, replies, strict=True):
                present[i] = reply == 1
                if isinstance(reply, ServerError):
                    self._reply_problem(reply)
                    errors += 1
        if errors:
            self._counters.add(errors=errors)
        return present

    def read_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        self._check_batch(keys, buffers)
        views = page_views(buffers, self.page_bytes, writable=True)
        rkeys = self._rkeys(keys)
        verdicts = Verdicts(len(keys))
        deadline = Deadline(self.options.timeout_s)
        for endpoint, idx in self._router.route(rkeys):
            work = get_pages([rkeys[i] for i in idx], [views[i] for i in idx], HEADER_BYTES,
                             self._pages_per_trip)
            replies = self._run(endpoint, work, deadline)
            if replies is None:
                verdicts.errors += len(idx)
                continue
            self._judge.judge(keys, replies, views, verdicts, idx)
        if verdicts.moved:
            self._router.moved()
        hits = sum(verdicts.found)
        self._counters.add(hits=hits, misses=len(keys) - hits, corrupt=verdicts.corrupt,
                           errors=verdicts.errors, bytes_read=hits * self.page_bytes)
        if verdicts.bad:
            self._drop_damaged([keys[i] for i in verdicts.bad])
        return verdicts.found

    def _drop_damaged(self, keys: list[bytes]) -> None:
        """Delete values that failed verification, so that ``contains`` stops promising them
        and the next write stores a good copy (a good copy another writer stored since the read
        goes too: one more miss, never a wrong page)."""
        dropped = self.delete(keys)
        self._counters.add(dropped=dropped)
        log.warning("redis store %s: deleted %d of %d values that failed verification; the next "
                    "write stores them again", self.url, dropped, len(keys))

    def write(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        self._check_batch(keys, buffers)
        payloads = page_views(buffers, self.page_bytes, writable=False)
        rkeys = self._rkeys(keys)
        header = self._judge.expected_header
        headers = [header(k, p) for k, p in zip(keys, payloads, strict=True)]
        stored = [False] * len(keys)
        deadline = Deadline(self.options.timeout_s)
        errors = 0
        for endpoint, idx in self._router.route(rkeys):
            work = set_pages([rkeys[i] for i in idx], [headers[i] for i in idx],
                             [payloads[i] for i in idx], self.options.ttl_s)
            replies = self._run(endpoint, work, deadline)
            if replies is None:
                errors += len(idx)
                continue
            for i, reply in zip(idx, replies, strict=True):
                stored[i] = reply == "OK"
                if isinstance(reply, ServerError):
                    self._reply_problem(reply)
                    errors += reply.kind != "OOM"  # OOM: full, a plain refusal
        done = sum(stored)
        self._counters.add(refused=len(keys) - done, errors=errors,
                           bytes_written=done * self.page_bytes)
        return stored

    def delete(self, keys: Sequence[bytes]) -> int:
        self._check_open()
        rkeys = self._rkeys(keys)
        deadline = Deadline(self.options.timeout_s)
        removed = errors = 0
        for endpoint, idx in self._router.route(rkeys):
            replies = self._run(endpoint, per_key(b"DEL", [rkeys[i] for i in idx]), deadline)
            if replies is None:
                errors += len(idx)
                continue
            removed += sum(r for r in replies if isinstance(r, int))
            errors += sum(isinstance(r, ServerError) for r in replies)
        if errors:
            self._counters.add(errors=errors)
        return removed

    def stats(self) -> StoreStats:
        counters = self._counters.snapshot()
        counters.pop("evicted")
        servers = [] if self._closed else self.server_info()
        answered = [s for s in servers if s.get("reachable")]
        limits = [s.get("maxmemory", 0) for s in answered]
        capacity = sum(limits) if answered and all(limits) else None
        return StoreStats(backend=self.scheme, pages=sum(s.get("keys", 0) for s in answered),
                          bytes=sum(s.get("used_memory", 0) for s in answered),
                          capacity_bytes=capacity, evicted=self._evictions.total, **counters)

    def server_info(self) -> list[dict[str, Any]]:
        """Per server: reachable, keys (DBSIZE or prefix count), used_memory, maxmemory,
        maxmemory_policy, evicted_keys (server lifetime) and the breaker's state."""
        match = None
        if self.options.page_count == "scan":
            match = glob_escape(self._prefix) + b"*"
        out = []
        for endpoint in self._router.endpoints():
            deadline = Deadline(self.options.timeout_s)
            info = self._run(endpoint, server_info(match), deadline)
            row: dict[str, Any] = {"endpoint": endpoint.name, "reachable": info is not None,
                                   "breaker": endpoint.breaker.stats().state}
            if info is not None:
                self._evictions.observe(endpoint.name, int(info.get("evicted_keys", 0)))
                for name in ("keys", "used_memory", "maxmemory", "maxmemory_policy",
                             "evicted_keys"):
                    row[name] = info.get(name, 0)
            out.append(row)
        return out

    def probe(self) -> Probe:
        """Unreachable while any server's breaker is open or the marker check fails; pages
        lost when the run marker changed (a restart empty, a flush)."""
        down = [name for name, state in self.breaker_states().items() if state != "closed"]
        if down:
            return Probe(f"redis {', '.join(down)} unreachable: its pages miss and writes are "
                         "refused until it answers (probed in the background)", "unreachable")
        try:
            lost = self._check_marker()
        except EndpointDown as exc:
            return Probe(f"unreachable ({exc}): its pages miss and writes are refused until it "
                         "answers", "unreachable")
        return Probe(lost=lost)

    def _check_marker(self) -> bool:
        """Whether the run marker changed since the last check (see ``marker``)."""
        for endpoint, _ in self._router.route([self._marker.rkey]):
            if endpoint is not None:
                return self._marker.check(endpoint, self.options.timeout_s)
        return False

    def breaker_states(self) -> dict[str, str]:
        """Each server's breaker state (closed, open, half_open), without calling any."""
        return {e.name: e.breaker.stats().state for e in self._router.endpoints()}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._router.close()
