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
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from chaos_disk_faults import run_file_faults, writer_main
from chaos_kvtier import KvtierFile
from chaos_pages import (
    FILE_FAULTS,
    PAGES,
    REDIS_FAULTS,
    ROOT,
    TARGETS,
    Count,
    patch,
    tmpfs,
)
from chaos_redis_faults import run_redis_faults

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
