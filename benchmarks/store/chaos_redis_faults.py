"""The chaos suite's Redis faults (``chaos.py``) on kvtier's Redis store, against a real
``redis-server`` started as the tests start it: a record damaged in place (bit flip, zeroed
range, truncation, another page's payload, an older format), another tenant's value under this
tenant's key, eviction mid-read, a restart that empties the server, a paused server, dropped
connections. ``run_redis_faults`` runs them all (skipped when no ``redis-server`` is found).

Runs in the ``kvtier-redis`` ``--worker`` process (or a test) on its main thread; the eviction
and dropped-connection faults each start a daemon thread (a filler writer, a connection killer)
that runs beside the reads until the fault ends."""

from __future__ import annotations

import contextlib
import struct
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from chaos_driver import score
from chaos_kvtier import KvtierRedis
from chaos_pages import BASE, PAGES, REDIS_FAULTS, ROOT, TARGETS, Count, expected, older_format


def fault_redis(ad: KvtierRedis, fault: str) -> Count:
    server = ad.server
    client = server.client()
    client.flushall()
    h = ad.open(Path("."), BASE)
    assert all(ad.put(h, BASE, list(range(PAGES)), [expected(BASE, i) for i in range(PAGES)]))
    damaged: set[int] = set(TARGETS)
    reusable = True
    try:
        if fault == "bit_flip":
            for i in TARGETS:
                k = ad.rkey(BASE, i)
                value = bytearray(client.get(k))
                value[64 + 1000] ^= 0x10
                client.set(k, bytes(value))
        elif fault == "zeroed_range":
            for i in TARGETS:
                client.setrange(ad.rkey(BASE, i), 64 + 1024, bytes(512))
        elif fault == "truncated":
            for i in TARGETS:
                k = ad.rkey(BASE, i)
                value = client.get(k)
                client.set(k, value[:len(value) // 2])
        elif fault == "other_page_copied":  # the other page's payload under this header
            for i in TARGETS:
                k = ad.rkey(BASE, i)
                own, other = client.get(k), client.get(ad.rkey(BASE, i + 1))
                client.set(k, own[:64] + other[64:])
        elif fault == "stale_older_format":
            import zlib

            from kvtier.store.record import payload_checksum

            for i in TARGETS:
                k = ad.rkey(BASE, i)
                value = client.get(k)
                payload = older_format(expected(BASE, i))
                f = list(struct.unpack("<4sHHIQQ32s", value[:60]))
                f[1], f[5] = 0, payload_checksum(payload)
                body = struct.pack("<4sHHIQQ32s", *f)
                client.set(k, body + struct.pack("<I", zlib.crc32(body)) + payload)
        elif fault == "tenant_overwrite":
            # Another tenant (another model on the same server) writes its record for its own
            # page under this tenant's key (a shared prefix setting, a bug, a restore).
            other = replace(BASE, model="tenant-b")
            h2 = ad.open(Path("."), other, query="timeout_s=0.5&prefix=tenant-b:")
            ad.put(h2, other, list(TARGETS), [expected(other, i) for i in TARGETS])
            h2.close()
            for i in TARGETS:
                value = client.get(b"tenant-b:" + ad.keys(other, [i])[0].hex().encode())
                client.set(ad.rkey(BASE, i), value)
        elif fault == "evicted_mid_read":
            return _redis_evicted(ad, h, client)
        elif fault == "restarted_empty":
            server.restart()
            damaged, reusable = set(range(PAGES)), False
        elif fault == "slow_server":
            return _redis_slow(ad, h, client)
        elif fault == "connection_dropped":
            return _redis_dropped(ad, h, client)
        return score(ad, h, BASE, damaged, reusable=reusable)
    finally:
        h.close()
        client.close()


def _redis_evicted(ad: KvtierRedis, h: Any, client: Any) -> Count:
    c = Count()
    stop = threading.Event()

    def pressure() -> None:
        filler = bytes(64 << 10)
        n = 0
        while not stop.is_set():
            client.set(f"filler:{n}".encode(), filler)
            n += 1

    client.config_set("maxmemory-policy", "allkeys-lru")
    client.config_set("maxmemory", str(int(client.info("memory")["used_memory"]) + (256 << 10)))
    try:
        _reads_beside(ad, h, c, pressure, stop, 30)
    finally:
        client.config_set("maxmemory", "0")
    c.note = f"30 reads of {PAGES} pages while another writer fills memory"
    return c


def _redis_slow(ad: KvtierRedis, h: Any, client: Any) -> Count:
    c = Count()
    worst = 0.0
    for pause_ms in (100, 1000, 5000):
        admin = ad.server.client()
        admin.execute_command("CLIENT", "PAUSE", pause_ms, "ALL")
        t0 = time.monotonic()
        got = score(ad, h, BASE, set(range(PAGES)), reusable=False)
        worst = max(worst, time.monotonic() - t0)
        c.wrong += got.wrong
        c.refused += got.refused
        c.errors += got.errors
        admin.execute_command("CLIENT", "UNPAUSE")
        admin.close()
        after = score(ad, h, BASE, set(), reusable=True)  # served again once it answers
        deadline = time.monotonic() + 10
        while after.lost and time.monotonic() < deadline:
            time.sleep(0.2)
            after = score(ad, h, BASE, set(), reusable=True)
        c.wrong += after.wrong
        c.lost += after.lost
    c.note = f"pauses 0.1/1/5 s; slowest read call {worst:.2f} s (deadline 0.5 s)"
    return c


def _redis_dropped(ad: KvtierRedis, h: Any, client: Any) -> Count:
    c = Count()
    stop = threading.Event()

    def killer() -> None:
        admin = ad.server.client()
        while not stop.is_set():
            with contextlib.suppress(Exception):
                admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
            time.sleep(0.003)
        admin.close()

    _reads_beside(ad, h, c, killer, stop, 40)
    c.note = f"40 reads of {PAGES} pages while connections are killed every 3 ms"
    return c


def _reads_beside(ad: KvtierRedis, h: Any, c: Count, background: Any, stop: threading.Event,
                  rounds: int) -> None:
    """Score ``rounds`` reads of every page into ``c`` while ``background`` runs on a thread
    (until ``stop`` is set, which this does once the reads are over)."""
    thread = threading.Thread(target=background, daemon=True)
    thread.start()
    try:
        for _ in range(rounds):
            got = score(ad, h, BASE, set(range(PAGES)), reusable=False)
            c.wrong += got.wrong
            c.refused += got.refused
            c.errors += got.errors
    finally:
        stop.set()
        thread.join()


def run_redis_faults(faults: tuple[str, ...] = REDIS_FAULTS) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "tests"))
    from redis_server import REDIS_SERVER, RedisServer

    if REDIS_SERVER is None:
        return {f: Count(note="skipped: no redis-server").as_dict() for f in faults}
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "redis").start()
        try:
            ad = KvtierRedis(Path(tmp), server)
            for fault in faults:
                out[fault] = fault_redis(ad, fault).as_dict()
        finally:
            server.stop()
    return out
