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

This file is the command line, the runner and the report: the parent process starts one
``--worker`` per system under that system's Python, collects each worker's ``RESULT`` line,
prints the table and writes the JSON; ``--worker`` and ``--writer`` enter the same file in
those subprocesses. The parts live beside it, imported by name:

- ``chaos_pages.py``: the fault catalogue, the model's shape, the synthetic pages, ``Count``;
- ``chaos_driver.py``: the ``Adapter`` interface every store driver implements, and scoring;
- ``chaos_kvtier.py``: kvtier's disk and Redis store drivers;
- ``chaos_peers.py``: vLLM's, SGLang's and LMCache's drivers;
- ``chaos_disk_faults.py``: the disk faults on any driver, with the kill -9 writer;
- ``chaos_redis_faults.py``: the Redis faults on kvtier's Redis store;
- ``chaos_serve.py``: ``kvtier serve`` restarted on a damaged disk directory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from chaos_disk_faults import run_file_faults, writer_main
from chaos_pages import FILE_FAULTS, PAGES, REDIS_FAULTS, ROOT, TARGETS
from chaos_redis_faults import run_redis_faults
from chaos_serve import run_server_faults


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
