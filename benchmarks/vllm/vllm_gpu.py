"""kvtier's connector inside a real CUDA vLLM, side by side with vLLM's own paths, in one run.

Every case runs in a fresh process (``--case NAME``) on one GPU, with an 8B-shaped model
(``--preset``, random weights: ``load_format="dummy"``, nothing downloaded), bf16, prompts of
``--lengths`` tokens (seeded random ids), an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING
=0``) so the script reaches kvtier's runtime. TTFT is the wall time of ``llm.generate`` with
``max_tokens=1``, the median of ``--repeats`` runs. Cases, each under vLLM's default compilation
(``graphs``: torch.compile and CUDA graphs) and ``--eager``, as ``--modes`` says:

- ``recompute``: vLLM alone, prefix caching off (the baseline of every ratio);
- ``alone``: vLLM alone, prefix caching on: a GPU prefix hit (the same prompt again) and the
  TTFT of prompts it has not seen (the miss path's baseline); with ``graphs``, the serving
  throughput of ``--batch`` distinct ~5k-token prompts of 128 new tokens each, at once;
- ``native``: vLLM's native CPU offloading (``kv_offloading_backend="native"``,
  ``--offload-gib``): store, let the offload land, reset the GPU prefix cache, replay;
- ``kvtier``: kvtier's connector, host tier only (``--host-gib``): store, drain, forget kvtier's
  device tier, reset vLLM's prefix cache, replay (a host-tier hit); then, as in ``alone``, the
  TTFT of unseen prompts and (``graphs``) the throughput with kvtier on and no hit (the miss
  path);
- ``disk_store`` then ``disk_hit``: kvtier with a disk tier and the connector's defaults (the
  direct path on CUDA; ``kvtier`` and its non-direct variants take the staged path, with
  ``--staging-pages``); the first process stores the
  prompts and exits (its exit hook drains the writes); with ``--disk-cache cold`` (the
  default) the parent then drops the store's files from the OS page cache (``disk_probe.evict``),
  so the hit reads the disk (``warm``: whatever the page cache kept); a fresh process first
  computes two unseen prompts of the longest length (so the connector has timed vLLM's prefill,
  as in a process that has served traffic: ``kvtier.integrations.vllm.pricing``), serves
  the stored prompts from disk (its first request of each prompt), then forgets its host and device tiers
  (and, when cold, the page cache again between repeats: see ``vllm_gpu_case.py``) and serves
  them again ``--repeats`` times. After them the parent reads the store's files once with
  ``O_DIRECT`` (``disk_probe.py``) and prints the disk's own GB/s and what each length's KV
  takes at that speed: the floor under a disk hit on this machine.

Every hit also generates 16 greedy tokens, compared with ``recompute``'s in the same mode; the
``--check-lengths`` prompts (one token past a page, so the hit leaves a single token to compute:
a full-CUDA-graph decode step under ``graphs``) are checked for tokens only.

    PYTHONPATH=src python3 benchmarks/vllm/vllm_gpu.py --out $OUT        # on the GPU machine

prints a table per mode and writes ``vllm_gpu.json`` (results, ratios, machine) and
``vllm_gpu_cases.log`` (every child's output) under ``--out``.

Modules (this folder): ``vllm_gpu_case.py`` (one case in its child process, the shared
settings and prompts), ``vllm_gpu_report.py`` (the tables over every case); this script keeps
the command line, the parent that runs each case as a child of this script, and the child's
entry point.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from vllm_gpu_case import CASES, Case, emit, log
from vllm_gpu_report import summarize


# ================================================================================================
# child: one case in one process (``vllm_gpu_case.Case``)
# ================================================================================================
def child_main(args: argparse.Namespace) -> None:
    case, code = Case(args), 0
    try:
        case.run()
    except BaseException as exc:
        case.res["error"] = f"{type(exc).__name__}: {exc}"
        print(traceback.format_exc()[-6000:], flush=True)
        code = 1
    emit("RESULT", **case.res)
    sys.stdout.flush()
    if case.name == "disk_store" and case.llm is not None:
        from kvtier.integrations.vllm.runtime import runtimes

        for rt in runtimes():                              # writes reach the disk first
            rt.close(120.0)
    os._exit(code)           # skip interpreter teardown (engine threads can hang it)


# ================================================================================================
# parent
# ================================================================================================
def build_model_dir(preset: str, dest: Path) -> None:
    from kvtier.engine.presets import PRESETS, TOKENIZER_DIR

    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(dict(PRESETS[preset].config), indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, dest / name)


def run_child(args: argparse.Namespace, case: str, mode: str, timeout_s: float,
              logf: Any, script: str = __file__) -> dict[str, Any]:
    """Run ``script --case CASE --mode MODE`` (and ``args.child_argv``) in a fresh process,
    killed after ``timeout_s``; its ``@@RESULT`` line is the result (or an error and the tail
    of its output)."""
    cmd = [sys.executable, "-u", script, "--case", case, "--mode", mode, *args.child_argv]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1")
    result: dict[str, Any] = {"case": case, "mode": mode, "ok": False, "lengths": {}}
    logf.write(f"\n===== {case} / {mode} =====\n")
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, stdin=subprocess.DEVNULL, bufsize=1)
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    tail: list[str] = []
    try:
        for line in proc.stdout:                            # type: ignore[union-attr]
            logf.write(line)
            line = line.rstrip("\n")
            tail = (tail + [line])[-30:]
            if line.startswith("@@RESULT "):
                result = json.loads(line[len("@@RESULT "):])
            elif line.startswith("@@LENGTH "):
                part = json.loads(line[len("@@LENGTH "):])
                result["lengths"][str(part["length"])] = part["result"]
            elif line.startswith("[bench]") or "Traceback" in line or "Error" in line:
                print(f"  {line[:300]}", flush=True)
        proc.wait()
    finally:
        timer.cancel()
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if not result.get("ok"):
        result.setdefault("error", f"exit {proc.returncode}")
        result["tail"] = tail
    return result

def parent_main(args: argparse.Namespace) -> None:
    from kvtier.machine import write_report

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    build_model_dir(args.preset, Path(args.model_dir))
    shutil.rmtree(args.disk_dir, ignore_errors=True)
    plan = [(c, m) for m in args.modes for c in args.cases if c not in ("disk_store", "disk_hit")]
    if "disk_store" in args.cases:
        plan += [("disk_store", args.disk_mode), ("disk_hit", args.disk_mode)]
    deadline = time.monotonic() + args.budget_s
    results = []
    with open(out / "vllm_gpu_cases.log", "w") as logf:
        for case, mode in plan:
            left = deadline - time.monotonic()
            if left < 30:
                results.append({"case": case, "mode": mode, "ok": False, "error": "no time left"})
                continue
            if case == "disk_hit" and args.disk_cache == "cold" and Path(args.disk_dir).is_dir():
                from disk_probe import evict

                log(f"page cache dropped for the store: {evict(Path(args.disk_dir))}")
            log(f"case {case} / {mode} ({left:.0f} s left)")
            results.append(run_child(args, case, mode, min(left, args.case_timeout_s), logf))
            logf.flush()
            write_report(out / "vllm_gpu.json", "vllm_gpu", {     # so far (a cut-off run keeps it)
                "args": {k: v for k, v in vars(args).items() if k != "child_argv"},
                "cases": results})
    summary = summarize(args, results)
    if any(r["case"] == "disk_hit" for r in results) and Path(args.disk_dir).is_dir():
        summary["disk_raw_read"] = disk_floor(args)
    failed = [f"{r['case']}/{r['mode']}: {r.get('error')}" for r in results if not r.get("ok")]
    if failed:
        print("failed cases: " + "; ".join(failed))
    for r in results:
        for warning in r.get("warnings", ()):
            print(f"WARNING {r['case']}/{r['mode']}: {warning}")
    write_report(out / "vllm_gpu.json", "vllm_gpu", {
        "args": {k: v for k, v in vars(args).items() if k != "child_argv"},
        "summary": summary, "cases": results})
    print(f"wrote {out / 'vllm_gpu.json'}")


def disk_floor(args: argparse.Namespace) -> dict[str, Any]:
    """The disk's own read speed under the disk cases' store, and what each prompt length's
    KV takes at that speed (the floor under a disk hit on this machine)."""
    from disk_probe import raw_read
    from vllm_serve_plan import kv_bytes_per_token

    probe = raw_read(Path(args.disk_dir))
    per_token = kv_bytes_per_token(args.preset, args.dtype)
    if probe["gb_s"]:
        probe["floor_ms"] = {str(n): round(n * per_token / (probe["gb_s"] * 1e9) * 1e3, 1)
                             for n in args.lengths}
    print(f"disk under {args.disk_dir}: {probe}")
    return probe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=CASES, help="(internal) run one case in this process")
    p.add_argument("--mode", choices=("graphs", "eager"), default="eager")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--modes", default="graphs,eager")
    p.add_argument("--disk-mode", default="eager", help="mode of the disk cases")
    p.add_argument("--preset", default="llama3-8b-shape")
    p.add_argument("--model-dir", default="/tmp/kvtier_bench_model")
    p.add_argument("--disk-dir", default="/tmp/kvtier_bench_disk")
    p.add_argument("--disk-cache", choices=("cold", "warm"), default="cold",
                   help="drop the store's files from the OS page cache before the disk hits")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--lengths", default="4096,32768")
    p.add_argument("--check-lengths", default="4097")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=33024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-mem", type=float, default=0.6)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="throughput prompts (0: none)")
    p.add_argument("--profile", type=int, default=0,
                   help="1: one more hit per host-hit case under torch.profiler (top operations)")
    p.add_argument("--unseen", type=int, default=1, help="time unseen prompts (the miss path)")
    p.add_argument("--offload-gib", type=float, default=12.0,
                   help="vLLM's native CPU offloading size, and kvtier's host tier")
    p.add_argument("--staging-pages", type=int, default=2600,
                   help="kvtier's device pool (pages of --block-size tokens)")
    p.add_argument("--budget-s", type=float, default=560.0, help="all cases together")
    p.add_argument("--case-timeout-s", type=float, default=240.0)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args, _ = p.parse_known_args()
    args.child_argv = [a for a in sys.argv[1:]]
    args.host_gib = int(args.offload_gib)
    args.lengths = [int(x) for x in str(args.lengths).split(",") if x]
    args.check_lengths = [int(x) for x in str(args.check_lengths).split(",") if x]
    args.modes = [m for m in str(args.modes).split(",") if m]
    args.cases = [c for c in str(args.cases).split(",") if c]
    if args.case:
        child_main(args)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
