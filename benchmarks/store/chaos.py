"""Chaos suite: every store driven through the same faults; per fault, pages served wrong,
refused, errors raised to the caller, and pages lost that should have survived.

Systems, each through its own public storage API, each in a subprocess under its own Python:

- ``kvtier-file``: kvtier's disk tier (``file://``) behind the ``StoreGuard`` a cache holds;
- ``kvtier-redis``: kvtier's Redis store (a real ``redis-server``, as the tests start it);
- ``vllm-fs``: vLLM's ``fs`` secondary tier (``FileMapper`` names, ``batch_store_block`` /
  ``batch_load_block`` move blocks; a failed load is a miss, as its tier manager treats it);
- ``sglang-file``: SGLang's ``HiCacheFile`` (``set`` / ``get`` / ``exists``);
- ``lmcache-disk``: LMCache's ``LocalDiskBackend`` when ``--lmcache-python`` names a Python
  with ``lmcache`` installed.

The model is small (2 layers, 2 KV heads of 32, pages of 16 tokens, bf16: 8 KiB a page) and
its KV is synthetic: page ``i``'s bytes are a pure function of (model, weights, dtype, shape,
page size, i), so a served page is checked exactly. Keys come from each system's own scheme
(kvtier: ``KeyNamespace`` with the checkpoint fingerprint of ``kvtier.model_identity``; the
peers: a chain hash of the page's tokens, placed by their own mappers).

Counts, per fault and system: ``wrong`` (served, bytes not the page asked for), ``refused``
(a miss), ``errors`` (an exception reached the caller of the API), ``lost`` (a page the fault did
not touch, or one acknowledged before a kill -9, that is no longer served). ``n/a``: the fault
has no meaning for the system (no index file, no Redis).

Run: ``python benchmarks/store/chaos.py --out benchmarks/results`` (as root: the full-disk and
read-only faults mount small tmpfs file systems; otherwise they are skipped and say so).
Writes ``chaos_cpu.json`` (with machine info) and prints the table. ``--worker SYSTEM`` runs one
system's faults in this process (what the parent runs under each venv).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from chaos_driver import Adapter, fresh, reopen_and_score, score
from chaos_kvtier import KvtierFile, KvtierRedis
from chaos_pages import (
    BASE,
    FILE_FAULTS,
    PAGES,
    REDIS_FAULTS,
    ROOT,
    TARGETS,
    Count,
    expected,
    older_format,
    patch,
    tmpfs,
)
from chaos_peers import LmcacheDisk, SglangFile, VllmFs

# ---- the faults ---------------------------------------------------------------------------


def fault_file(ad: Adapter, fault: str, root: Path, scratch: Path) -> Count:
    if fault == "kill9_mid_write":
        return _kill9(ad, root)
    if fault == "full_disk":
        return _full_disk(ad, scratch)
    if fault == "read_only_disk":
        return _read_only(ad, scratch)
    fresh(ad, root)
    damaged: set[int] = set(TARGETS)
    if fault == "bit_flip":
        for i in TARGETS:
            path, off, n = ad.locate(root, BASE, i)
            data = bytearray(path.read_bytes()[off + n // 3:off + n // 3 + 1])
            patch(path, off + n // 3, bytes([data[0] ^ 0x10]))
    elif fault == "zeroed_range":
        for i in TARGETS:
            path, off, _ = ad.locate(root, BASE, i)
            patch(path, off + 1024, bytes(512))
    elif fault == "truncated":
        damaged = ad.truncate(root, BASE, TARGETS)
    elif fault == "other_page_copied":
        for i in TARGETS:
            path, off, n = ad.locate(root, BASE, i)
            src, soff, _ = ad.locate(root, BASE, i + 1)
            with open(src, "rb") as f:
                f.seek(soff)
                payload = f.read(n)
            patch(path, off, payload)
    elif fault == "stale_older_format":
        for i in TARGETS:
            ad.rewrite_older_format(root, BASE, i, older_format(expected(BASE, i)))
    elif fault in ("deleted_index", "deleted_manifest"):
        patterns = ad.index_files if fault == "deleted_index" else ad.manifest_files
        if not patterns:
            return Count(note="n/a")
        for pattern in patterns:
            for path in root.glob(pattern):
                path.unlink()
        damaged = set()
    elif fault == "clock_skew":
        damaged = set()
        now = time.time()
        for n, path in enumerate(sorted(root.rglob("*"))):
            stamp = now + 10 * 365 * 86400 if n % 2 else 1.0  # ten years ahead, or 1970
            os.utime(path, (stamp, stamp))
        h = ad.open(root, BASE)  # and the store keeps working: new pages go in and come out
        more = replace(BASE, prompt=1)
        ok = ad.put(h, more, list(range(4)), [expected(more, i) for i in range(4)])
        c2 = score(ad, h, more, set(), idx=[i for i in range(4) if ok[i]])
        ad.close(h)
        c = reopen_and_score(ad, root, BASE, damaged)
        c.wrong += c2.wrong
        c.errors += c2.errors
        c.lost += c2.lost
        return c
    else:
        new = {"other_shape": replace(BASE, kv_heads=4),
               "other_page_size": replace(BASE, page_tokens=32),
               "other_dtype": replace(BASE, dtype="float8_e4m3fn"),
               "other_tp_size": replace(BASE, tp=2, rank=0),
               "fine_tune_same_name": replace(BASE, weights="tuned")}[fault]
        if fault == "other_tp_size" and not ad.restart_forgets:  # right for a TP 2 rank
            c = reopen_and_score(ad, root, new, set(), reusable=False)
            c.note = (c.note + " " if c.note else "") + f"{PAGES - c.refused} served"
            return c
        c = reopen_and_score(ad, root, new, set(range(PAGES)), reusable=False)
        if ad.restart_forgets:
            c.note = "a new server's index starts empty: nothing on disk is found"
        return c
    return reopen_and_score(ad, root, BASE, damaged)


def _kill9(ad: Adapter, root: Path, rounds: int = 4) -> Count:
    total = Count()
    acked: set[int] = set()
    tried: set[int] = set()
    rng = random.Random(11)
    for r in range(rounds):
        start = r * 1000
        proc = subprocess.Popen([sys.executable, __file__, "--writer", ad.name, "--root",
                                 str(root), "--start", str(start)],
                                stdout=subprocess.PIPE, text=True, env=os.environ.copy())
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == "open\n", line
        time.sleep(rng.uniform(0.05, 0.3))
        os.kill(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        lines = [ln for ln in out.splitlines(keepends=True) if ln.endswith("\n")]
        acked |= {int(x) for ln in lines for x in ln.split()}
        tried |= set(range(start, max(acked | {start}) + 8))
    cfg = replace(BASE, prompt=-1)
    h = ad.open(root, cfg)
    order = sorted(tried)
    for at in range(0, len(order), 64):
        chunk = order[at:at + 64]
        got = ad.get(h, cfg, chunk)
        for i, page in zip(chunk, got, strict=True):
            if page is None:
                if i in acked:
                    total.lost += 1
            elif page != expected(cfg, i):
                total.wrong += 1
    ad.close(h)
    total.note = f"{len(acked)} acknowledged over {rounds} kills"
    return total


def writer_main(system: str, root: Path, start: int) -> None:
    """Write pages in batches forever, printing the acknowledged ones (killed by the parent)."""
    scratch = root.parent / f"writer-{start}"
    scratch.mkdir(exist_ok=True)
    ad = adapter(system, scratch)
    cfg = replace(BASE, prompt=-1)
    h = ad.open(root, cfg)
    print("open", flush=True)
    i = start
    while True:
        idx = list(range(i, i + 4))
        ok = ad.put(h, cfg, idx, [expected(cfg, n) for n in idx])
        print(" ".join(str(n) for n, a in zip(idx, ok, strict=True) if a), flush=True)
        i += 4


def _full_disk(ad: Adapter, scratch: Path) -> Count:
    if os.geteuid() != 0:
        return Count(note="skipped: mounting a small tmpfs needs root")
    c = Count()
    with tmpfs(scratch, "256k") as root:
        h = ad.open(root, BASE)
        acked: set[int] = set()
        for i in range(PAGES):  # 24 pages of 8 KiB + metadata into 256 KiB ... then past it
            try:
                ok = ad.put(h, BASE, [i], [expected(BASE, i)])
            except Exception as exc:
                c.errors += 1
                c.note = f"write: {type(exc).__name__}"
                continue
            if ok[0]:
                acked.add(i)
        filler = root / "filler"
        with contextlib.suppress(OSError), open(filler, "wb") as f:
            f.write(bytes(1 << 20))  # whatever room is left, taken by another program
        more = replace(BASE, prompt=2)
        try:
            ok = ad.put(h, more, list(range(4)), [expected(more, n) for n in range(4)])
            refused_writes = ok.count(False)
        except Exception as exc:
            c.errors += 1
            c.note = f"write when full: {type(exc).__name__}"
            refused_writes = 4
        ad.close(h)
        got = reopen_and_score(ad, root, BASE, set(range(PAGES)) - acked)
        c.wrong, c.lost = got.wrong, got.lost
        c.errors += got.errors
        c.refused = got.refused
        c.note = (c.note + "; " if c.note else "") + (
            f"{len(acked)} of {PAGES} acknowledged; {refused_writes}/4 writes refused when full")
    return c


def _read_only(ad: Adapter, scratch: Path) -> Count:
    if os.geteuid() != 0:
        return Count(note="skipped: remounting read-only needs root")
    with tmpfs(scratch, "16m") as root:
        fresh(ad, root)
        subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
        c = reopen_and_score(ad, root, BASE, set())
        try:
            h = ad.open(root, BASE)
            more = replace(BASE, prompt=3)
            ok = ad.put(h, more, list(range(4)), [expected(more, n) for n in range(4)])
            c.note = f"{ok.count(False)}/4 new writes refused"
            ad.close(h)
        except Exception as exc:
            c.errors += 1
            c.note = f"write: {type(exc).__name__}: {exc}"[:160]
    return c


# ---- Redis faults (kvtier's Redis store) ----------------------------------------------------
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
    thread = threading.Thread(target=pressure, daemon=True)
    thread.start()
    try:
        for _ in range(30):
            got = score(ad, h, BASE, set(range(PAGES)), reusable=False)
            c.wrong += got.wrong
            c.refused += got.refused
            c.errors += got.errors
    finally:
        stop.set()
        thread.join()
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

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        for _ in range(40):
            got = score(ad, h, BASE, set(range(PAGES)), reusable=False)
            c.wrong += got.wrong
            c.refused += got.refused
            c.errors += got.errors
    finally:
        stop.set()
        thread.join()
    c.note = f"40 reads of {PAGES} pages while connections are killed every 3 ms"
    return c


# ---- kvtier's server end to end (the engine a ``kvtier serve`` runs, embedded tiny model) ----
SERVE_FAULTS = ("bit_flip", "zeroed_range", "truncated", "other_page_copied",
                "stale_older_format", "deleted_index", "fine_tune_same_name", "clock_skew",
                "read_only_disk")


def _records(root: Path) -> list[tuple[Path, int, int, int]]:
    """Every record of a kvtier disk store: (segment, header offset, payload offset, length)."""
    import zlib

    out = []
    for seg in sorted((root / "segments").glob("*.seg")):
        data = seg.read_bytes()
        at = data.find(b"KVTR")
        while at >= 0:
            head = data[at:at + 64]
            if len(head) == 64 and zlib.crc32(head[:60]) == struct.unpack("<I", head[60:])[0]:
                _, _, _, place, length, _, _ = struct.unpack("<4sHHIQQ32s", head[:60])
                out.append((seg, at, place * 512, length))
            at = data.find(b"KVTR", at + 1)
    return out


def _damage_store(fault: str, root: Path) -> None:
    import zlib

    records = _records(root)
    for n, (seg, head, off, length) in enumerate(records):
        if fault == "bit_flip":
            with open(seg, "r+b") as f:
                f.seek(off + length // 3)
                byte = f.read(1)[0]
                f.seek(off + length // 3)
                f.write(bytes([byte ^ 0x10]))
        elif fault == "zeroed_range":
            patch(seg, off + length // 4, bytes(min(512, length // 2)))
        elif fault == "other_page_copied" and len(records) > 1:
            src, _, soff, _ = records[(n + 1) % len(records)]
            with open(src, "rb") as f:
                f.seek(soff)
                patch(seg, off, f.read(length))
        elif fault == "stale_older_format":
            body = bytearray(seg.read_bytes()[head:head + 60])
            body[4:6] = struct.pack("<H", 0)
            patch(seg, head, bytes(body) + struct.pack("<I", zlib.crc32(bytes(body))))
    if fault == "truncated":
        for seg in sorted((root / "segments").glob("*.seg")):
            os.truncate(seg, seg.stat().st_size // 2)
    elif fault == "deleted_index":
        for pattern in KvtierFile.index_files:
            for path in root.glob(pattern):
                path.unlink()
    elif fault == "clock_skew":
        for n, path in enumerate(sorted(root.rglob("*"))):
            stamp = time.time() + 10 * 365 * 86400 if n % 2 else 1.0
            os.utime(path, (stamp, stamp))


def _serve_prompts() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(5, 1000) for _ in range(320)]
    return [shared[:rng.randrange(200, 320)] + [rng.randrange(5, 1000) for _ in range(40)]
            for _ in range(6)]


def _service(disk: Path | None, seed: int, cache: bool = True) -> Any:
    from kvtier.config import build_config
    from kvtier.engine.service import EngineService

    flags = {"engine.model": "tiny-llama", "engine.device": "cpu", "engine.dtype": "float32",
             "engine.seed": str(seed), "cache.enabled": str(cache).lower(),
             "cache.page_size": "16", "host.pool_bytes": "8MiB" if cache else "0",
             "controller.min_prefetch_tokens": "0",
             "controller.prefetch_policy": "wait_complete",
             "store.disk_url": f"file://{disk}" if disk else ""}
    return EngineService.build(build_config(env={}, flags=flags), max_running=1)


def _answers(service: Any, batch: list[list[int]]) -> tuple[list[list[int]], int]:
    from kvtier.engine.request import GenerationRequest

    out, disk_tokens = [], 0
    for prompt in batch:
        tokens, finish = service.submit(GenerationRequest(tuple(prompt), 12)).result(timeout=600)
        out.append(list(tokens))
        disk_tokens += finish.prefill.cached_by_tier.get("disk", 0)
    return out, disk_tokens


def run_server_faults(faults: tuple[str, ...] = SERVE_FAULTS) -> dict[str, Any]:
    """Per fault: a server with a disk tier answers the prompts and stops (its writes
    flushed); the fault hits its disk directory; a restarted server answers them again.
    ``wrong``: answers unlike ``--no-cache``'s; ``refused``: prompts that got no disk hit."""
    prompts_ = _serve_prompts()
    wants = {}
    for seed in (0, 1):
        plain = _service(None, seed, cache=False)
        try:
            wants[seed] = _answers(plain, prompts_)[0]
        finally:
            plain.close()
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fault in ("none", *faults):
            if fault == "read_only_disk" and os.geteuid() != 0:
                out[fault] = Count(note="skipped: remounting read-only needs root").as_dict()
                continue
            with contextlib.ExitStack() as stack:
                root = (stack.enter_context(tmpfs(Path(tmp), "4g")) if fault ==
                        "read_only_disk" else Path(tmp) / fault) / "disk"
                first = _service(root, 0)
                try:
                    _answers(first, prompts_)
                finally:
                    first.close()
                if fault == "read_only_disk":
                    subprocess.run(["mount", "-o", "remount,ro", str(root.parent)], check=True)
                else:
                    _damage_store(fault, root)
                seed = 1 if fault == "fine_tune_same_name" else 0
                c = Count()
                try:
                    again = _service(root, seed)
                    try:
                        got, disk_tokens = _answers(again, prompts_)
                    finally:
                        again.close()
                    c.wrong = sum(a != b for a, b in zip(got, wants[seed], strict=True))
                    c.note = f"{disk_tokens} prompt tokens served from disk"
                except Exception as exc:  # an error reached the client
                    c.errors = 1
                    c.note = f"{type(exc).__name__}: {exc}"[:160]
                out[fault] = c.as_dict()
    return out


# ---- workers and the parent ----------------------------------------------------------------
def adapter(system: str, scratch: Path, server: Any = None) -> Adapter:
    if system == "kvtier-file":
        return KvtierFile(scratch)
    if system == "kvtier-redis":
        return KvtierRedis(scratch, server)
    if system == "vllm-fs":
        return VllmFs()
    if system == "sglang-file":
        return SglangFile()
    if system == "lmcache-disk":
        return LmcacheDisk()
    raise SystemExit(f"unknown system {system}")


def run_file_faults(system: str, faults: tuple[str, ...] = FILE_FAULTS) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        ad = adapter(system, scratch)
        for fault in faults:
            root = scratch / fault
            root.mkdir()
            try:
                out[fault] = fault_file(ad, fault, root, scratch).as_dict()
            except Exception as exc:
                out[fault] = Count(errors=-1, note=f"harness: {type(exc).__name__}: {exc}"
                                   ).as_dict()
    return out


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


def worker_main(system: str) -> None:
    logging_quiet()
    if system == "kvtier-redis":
        result = run_redis_faults()
    elif system == "kvtier-serve":
        result = run_server_faults()
    else:
        result = run_file_faults(system)
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # peers leave non-daemon threads (IO pools) behind


def logging_quiet() -> None:
    import logging

    logging.disable(logging.CRITICAL)


SYSTEMS = {
    "kvtier-file": ("/work/main/.venv/bin/python", True),
    "kvtier-redis": ("/work/main/.venv/bin/python", True),
    "kvtier-serve": ("/work/main/.venv/bin/python", True),
    "vllm-fs": ("/work/main/.venv-vllm/bin/python", False),
    "sglang-file": ("/work/main/.venv-sglang/bin/python", False),
}


def run_system(system: str, python: str, with_src: bool, timeout: float = 900) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if with_src:
        env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.run([python, __file__, "--worker", system], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"_failed": f"rc={proc.returncode}: {proc.stderr[-1500:]}"}


def render(results: dict[str, dict[str, Any]]) -> str:
    systems = [s for s in results if s != "kvtier-serve"]
    faults = [*FILE_FAULTS, *(f"redis:{f}" for f in REDIS_FAULTS)]
    head = f"{'fault':26}" + "".join(f"{s:>15}" for s in systems)
    lines = [head, "-" * len(head)]
    for fault in faults:
        cells = []
        for s in systems:
            redis_row = fault.startswith("redis:")
            r = results[s].get(fault.removeprefix("redis:"))
            if (s == "kvtier-redis") != redis_row:
                cells.append("n/a")
            elif "_failed" in results[s]:
                cells.append("failed")
            elif r is None:
                cells.append("-")
            elif r.get("note", "").startswith(("n/a", "skipped")):
                cells.append(r["note"].split(":")[0])
            else:
                cells.append(f"{r['wrong']}/{r['refused']}/{r['lost']}"
                             + (f" E{r['errors']}" if r["errors"] else ""))
        lines.append(f"{fault:26}" + "".join(f"{c:>15}" for c in cells))
    lines.append("cells: pages served wrong / refused (a miss) / lost (untouched by the fault, or "
                 "acknowledged before a kill -9, and not served); E<n>: exceptions that reached "
                 "the caller")
    serve = results.get("kvtier-serve")
    if serve and "_failed" not in serve:
        lines += ["", "kvtier serve (embedded tiny-llama, CPU), restarted on the damaged disk "
                  "directory: wrong answers against --no-cache",
                  f"{'fault':26}{'wrong answers':>15}{'errors':>8}  disk tokens served"]
        for fault, r in serve.items():
            lines.append(f"{fault:26}{r['wrong']:>15}{r['errors']:>8}  {r['note']}")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "processor": platform.processor(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker")
    parser.add_argument("--writer")
    parser.add_argument("--root")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--systems", default=",".join([*SYSTEMS, "lmcache-disk"]))
    parser.add_argument("--lmcache-python", default="")
    args = parser.parse_args()
    if args.writer:
        writer_main(args.writer, Path(args.root), args.start)
        return
    if args.worker:
        worker_main(args.worker)
        return
    results: dict[str, dict[str, Any]] = {}
    if args.lmcache_python:
        SYSTEMS["lmcache-disk"] = (args.lmcache_python, False)
    for system in args.systems.split(","):
        if system not in SYSTEMS:
            results[system] = {"_failed": "no Python with it installed (--lmcache-python)"}
            continue
        python, with_src = SYSTEMS[system]
        t0 = time.monotonic()
        results[system] = run_system(system, python, with_src)
        print(f"{system}: {time.monotonic() - t0:.1f} s", file=sys.stderr)
    table = render(results)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "chaos_cpu.json").write_text(json.dumps(
            {"machine": machine(), "pages": PAGES, "targets": TARGETS, "results": results},
            indent=1) + "\n")


if __name__ == "__main__":
    main()
