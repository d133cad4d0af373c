"""The raw baseline of the Redis store's benchmark: ``redis-benchmark`` at the same value size.

Owns ``run_redis_benchmark`` (runs Redis's own C benchmark client for SET or GET of values of
a given size, against the server a store URL names: host, port, user, password, db, TLS,
cluster) and ``redis_py_pipeline`` (the same bytes through a plain redis-py pipeline with the
hiredis parser, as a second reference). ``measure`` is the entry ``kvtier bench store`` calls for
``redis://`` / ``rediss://`` URLs. Runs on the main thread of a benchmark; the redis-benchmark
binary comes from Debian's ``redis-tools`` (``scripts/install_system_deps.sh``).
"""

from __future__ import annotations

import csv
import io
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from kvtier.errors import ConfigError, StoreUnavailable

#: What redis-benchmark calls its tests.
_TESTS = {"write": "SET", "read": "GET"}


@dataclass(frozen=True)
class RawRate:
    """One redis-benchmark (or redis-py) run: what ran and how fast."""

    op: str            # write (SET) or read (GET)
    value_bytes: int
    requests: int
    clients: int
    pipeline: int
    requests_per_s: float

    @property
    def gbps(self) -> float:
        return self.requests_per_s * self.value_bytes / 1e9

    def as_dict(self) -> dict[str, Any]:
        return {"op": self.op, "value_bytes": self.value_bytes, "requests": self.requests,
                "clients": self.clients, "pipeline": self.pipeline,
                "requests_per_s": self.requests_per_s, "gbps": self.gbps}


def benchmark_args(url: str) -> list[str]:
    """redis-benchmark's connection flags for a store URL (kvtier-only query options ignored)."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ConfigError("store url", url, "a redis:// or rediss:// URL")
    query = dict(parse_qsl(parts.query))
    args = ["-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 6379)]
    if parts.password:
        args += ["-a", unquote(parts.password)]
        if parts.username:
            args += ["--user", unquote(parts.username)]
    db = parts.path.strip("/") or query.get("db", "")
    if db and db != "0":
        args += ["--dbnum", db]
    if parts.scheme == "rediss":
        args.append("--tls")
        if query.get("ssl_ca_certs"):
            args += ["--cacert", query["ssl_ca_certs"]]
        if query.get("ssl_cert_reqs", "").lower() in ("none", "optional"):
            args.append("--insecure")
    if query.get("cluster", "").lower() in ("1", "true", "yes", "on"):
        args.append("--cluster")
    return args


def run_redis_benchmark(url: str, op: str, value_bytes: int, *, requests: int, clients: int = 1,
                        pipeline: int = 32, keyspace: int = 0, timeout_s: float = 600) -> RawRate:
    """Run ``redis-benchmark -t SET|GET -d value_bytes`` and parse its requests per second.

    ``keyspace`` > 0 spreads requests over that many keys (``-r``); GET reads keys a SET run
    with the same keyspace wrote.
    """
    binary = shutil.which("redis-benchmark")
    if binary is None:
        raise StoreUnavailable("redis-benchmark is not installed (install redis-tools: "
                               "bash scripts/install_system_deps.sh)")
    cmd = [binary, *benchmark_args(url), "-t", _TESTS[op].lower(), "-d", str(value_bytes),
           "-n", str(requests), "-c", str(clients), "-P", str(pipeline), "--csv", "-q"]
    if keyspace:
        cmd += ["-r", str(keyspace)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise StoreUnavailable(f"redis-benchmark failed: {done.stderr.strip()[-500:]}")
    for row in csv.reader(io.StringIO(done.stdout)):
        if row and row[0] == _TESTS[op]:
            return RawRate(op, value_bytes, requests, clients, pipeline, float(row[1]))
    raise StoreUnavailable(f"redis-benchmark printed no {_TESTS[op]} result: {done.stdout[-300:]}")


def benchmark_key(i: int) -> bytes:
    """The name redis-benchmark gives key ``i`` of a ``-r`` keyspace."""
    return b"key:%012d" % i


def is_cluster(url: str) -> bool:
    return dict(parse_qsl(urlsplit(url).query)).get("cluster", "").lower() in ("1", "true", "yes",
                                                                               "on")


def _client(url: str) -> Any:
    import redis

    parts = urlsplit(url)
    ssl = {k: v for k, v in parse_qsl(parts.query) if k.startswith("ssl_")}
    plain = parts._replace(query="").geturl()
    if is_cluster(url):
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(plain, protocol=2, **ssl)
    return redis.Redis.from_url(plain, protocol=2, **ssl)


def fill_keyspace(url: str, value_bytes: int, keyspace: int, pipeline: int,
                  values: Sequence[Any] = ()) -> None:
    """Write every key a GET run over ``keyspace`` keys will read, once each. In a cluster,
    redis-benchmark tags keys per node itself, so it fills them (8 random passes: >99.9%)."""
    if is_cluster(url):
        run_redis_benchmark(url, "write", value_bytes, requests=8 * keyspace, pipeline=pipeline,
                            keyspace=keyspace)
        return
    client = _client(url)
    values = list(values) or [bytes(value_bytes)]
    try:
        for first in range(0, keyspace, pipeline):
            pipe = client.pipeline(transaction=False)
            for i in range(first, min(first + pipeline, keyspace)):
                pipe.set(benchmark_key(i), values[i % len(values)])
            pipe.execute()
    finally:
        client.close()


def drop_keyspace(url: str, keyspace: int, batch: int = 512) -> None:
    """Remove the keys redis-benchmark wrote (``key:*``)."""
    client = _client(url)
    try:
        if is_cluster(url):
            names = list(client.scan_iter(match="key:*", count=1000))
        else:
            names = [benchmark_key(i) for i in range(keyspace)]
        for first in range(0, len(names), batch):
            pipe = client.pipeline(transaction=False) if not is_cluster(url) else client.pipeline()
            for name in names[first:first + batch]:
                pipe.unlink(name)
            pipe.execute()
    finally:
        client.close()


def redis_py_pipeline(url: str, op: str, value_bytes: int, *, pages: int, batch: int,
                      rounds: int = 1) -> RawRate:
    """The same bytes through redis-py's own pipeline (hiredis parser), one connection; a
    read run reads the keys (``rawpy:N``) a write run with the same ``pages`` wrote."""
    import os

    client = _client(url)
    keys = [b"rawpy:%d" % i for i in range(pages)]
    value = os.urandom(value_bytes)
    try:
        start = time.perf_counter()
        for _ in range(rounds):
            for first in range(0, pages, batch):
                pipe = client.pipeline(transaction=False)
                for key in keys[first:first + batch]:
                    pipe.set(key, value) if op == "write" else pipe.get(key)
                pipe.execute()
        seconds = time.perf_counter() - start
    finally:
        client.close()
    return RawRate(op, value_bytes, pages * rounds, 1, batch, pages * rounds / seconds)


def measure(url: str, *, store: Any, keys: Sequence[bytes], sources: Sequence[memoryview],
            threads: int, batch: int, cold: bool, repeats: int) -> dict[str, Any]:
    """redis-benchmark SET and GET of ``store.page_bytes`` values over as many keys as the store
    benchmark moved, ``threads`` connections, ``batch``-deep pipelines (``kvtier bench store``'s
    raw baseline for redis:// and rediss://). Reads are the best of ``repeats``; ``cold`` has no
    meaning for a server's RAM and is ignored."""
    pages, size = len(keys), store.page_bytes
    run = {"requests": pages, "clients": threads, "pipeline": batch, "keyspace": pages}
    write = run_redis_benchmark(url, "write", size, **run)
    fill_keyspace(url, size, pages, batch, sources)
    reads = [run_redis_benchmark(url, "read", size, **run) for _ in range(max(1, repeats))]
    drop_keyspace(url, pages)
    best = max(reads, key=lambda r: r.requests_per_s)
    method = (f"redis-benchmark -t set|get -d {size} -n {pages} -r {pages} -c {threads} "
              f"-P {batch} (C client, hiredis), GET best of {len(reads)}")
    return {"raw_write_gbps": write.gbps, "raw_read_gbps": best.gbps, "raw_method": method,
            "raw_runs": [write.as_dict(), *(r.as_dict() for r in reads)]}
