"""Serving through ``vllm serve`` (the OpenAI server): vLLM alone, vLLM's native CPU offloading
and kvtier's connector, one after another on the same GPU, under the same workloads.

Each config is a fresh server process (its own process group, a free port), killed before the
next starts:

- ``alone``: vLLM with prefix caching, nothing below the GPU;
- ``native``: vLLM's own CPU offloading (``--kv-offloading-size GiB --kv-offloading-backend
  native``);
- ``kvtier``: kvtier's connector, host tier only (``host_pool_bytes`` = the same GiB,
  ``pinned_budget_bytes`` 4 GiB more);
- ``direct``: the same on kvtier's direct path (``"direct": true``: no staging pages, so its
  vLLM gets the same GPU KV bytes as ``alone`` and ``native``).

Every server gets the same model (a directory holding a config.json of one of kvtier's presets
and kvtier's tokenizer, random weights: ``--load-format dummy``), dtype, block size, prefix
caching, ``--enable-prompt-tokens-details`` (so usage reports ``cached_tokens``) and the same
GPU memory for KV, chosen from the workloads so that their working set does not fit on the GPU
(the point of a tier below it)::

    staging_tokens = concurrency x the longest prompt (kvtier's staging pages, --staging-pages)
    gpu_kv_tokens  = max(--gpu-kv-fraction x the largest working set,
                         --inflight-headroom x concurrency x the longest request
                         + staging_tokens)

The working set is every distinct full block of the workload's prompts plus its outputs
(``vllm_serve_plan.working_set_tokens``). The in-flight term keeps the requests in flight on the
GPU without preemption (a smaller cache would measure preemption, not offloading). kvtier's
staging pages are GPU memory beside vLLM's KV cache (a hit staged on its way from the host tier,
a prompt being stored, kvtier's device tier): they come out of kvtier's
``--kv-cache-memory-bytes``, so all three servers hold the same GPU bytes of KV
(``--kvtier-extra-gpu``: on top instead). They are sized so that each request in flight can
stage a whole prompt: a save that finds no free staging page is refused (counted
``vllm:kvtier_saves_refused_no_staging``). The host size, ``--host-gib``, defaults to 1.5 x the
largest working set, so both tiers below the GPU can keep a whole workload. The numbers and
which term won are in the JSON (``plan``).

Workloads (token-id prompts, seeded, the same for every config; kvtier's load generator,
``kvtier.bench.serve_load``, at ``--concurrency`` requests in flight):

- ``shared-prefix``: ``--groups`` groups of a ``--prefix-len``-token prefix, each request its
  group's prefix and ``--suffix-len`` tokens of its own, ``--rounds`` rounds in group order, so
  each prefix comes back after all the others went through the GPU;
- ``multi-turn``: ``--conversations`` chats of ``--turns`` turns
  (``serve_workloads.conversations``): every turn re-sends the whole history (a shared
  ``--system-len`` system prompt, earlier ``--user-len`` user messages and ``--output-len``
  replies) plus a new user message; all first turns, then all second turns, and so on (a turn is
  sent ``--conversations`` requests after the same chat's previous turn).

A warm-up of ``--concurrency`` short unrelated requests runs on each server first. Reported per
config and workload: TTFT p50/p99, ITL p50 (gaps between streamed chunks), requests/s, output
tokens/s, the share of prompt tokens the server reports cached, vLLM's prefix-cache and
preemption counters, kvtier's connector counters and the native offloading's from ``/metrics``
over the workload, and the ratios kvtier/native and kvtier/alone. A server that does not come
up is recorded with its log's tail and the lines naming an error, and the run goes on;
``--budget-s`` bounds the whole run, ``--config-timeout-s`` each server (past it the server is
killed, its requests in flight fail).

    PYTHONPATH=src python3 benchmarks/vllm/vllm_serve.py --out OUT         # on the GPU machine

writes ``vllm_serve_<gpu>.json`` (args, memory plan, results, ratios, machine), the table as
``vllm_serve_<gpu>.txt`` and every server's log under ``--out``. Main thread; the load
generator adds a thread per request in flight.

Modules (this folder): ``vllm_serve_plan.py`` (the workloads and the memory plan),
``vllm_serve_server.py`` (one server: its command, start, stop, counters and workloads),
``vllm_serve_report.py`` (the table); this script keeps the command line and the run over the
configs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from vllm_gpu import build_model_dir
from vllm_serve_plan import DTYPE_BYTES, WORKLOADS, build_workloads, log, plan_memory
from vllm_serve_report import gpu_tag, summarize_runs
from vllm_serve_server import CONFIGS, run_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--preset", default="llama3-8b-shape")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--model-dir", default="", help="where the model directory is built "
                   "(default: under --out)")
    p.add_argument("--block-size", type=int, default=16, help="vLLM's (32 on its CPU backend)")
    p.add_argument("--eager", action="store_true", help="--enforce-eager (no CUDA graphs)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--groups", type=int, default=24)
    p.add_argument("--prefix-len", type=int, default=4096)
    p.add_argument("--suffix-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--user-len", type=int, default=384)
    p.add_argument("--output-len", type=int, default=64,
                   help="tokens generated per request (and each earlier reply's length)")
    p.add_argument("--gpu-kv-fraction", type=float, default=0.25,
                   help="GPU KV cache as a share of the largest working set (at least)")
    p.add_argument("--inflight-headroom", type=float, default=1.25,
                   help="GPU KV cache at least this x concurrency x the longest request")
    p.add_argument("--gpu-kv-bytes", type=int, default=0, help="override the GPU KV cache")
    p.add_argument("--host-gib", type=float, default=0.0,
                   help="native offloading size and kvtier's host tier (0: 1.5 x working set)")
    p.add_argument("--staging-pages", type=int, default=0,
                   help="kvtier's staging pages (0: concurrency x the longest prompt's blocks)")
    p.add_argument("--kvtier-extra-gpu", action="store_true",
                   help="kvtier's staging pages on top of the GPU KV cache, not out of it")
    p.add_argument("--vllm-args", default="", help="more flags for every server")
    p.add_argument("--profile-loop", action="store_true",
                   help="profile every server's engine steps (loop_profile/sitecustomize.py) "
                        "into OUT/loop_profile_<config>/ (slows Python: compare shares)")
    p.add_argument("--budget-s", type=float, default=510.0, help="the whole run")
    p.add_argument("--config-timeout-s", type=float, default=300.0,
                   help="one server: start, warm-up and workloads")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    args.configs = [c for c in args.configs.split(",") if c]
    args.workloads = [w for w in args.workloads.split(",") if w]
    bad = [c for c in args.configs if c not in CONFIGS] + \
        [w for w in args.workloads if w not in WORKLOADS]
    if bad:
        p.error(f"unknown config or workload: {bad}")
    # A SIGTERM (an outer timeout) unwinds through ``finally``: the server is killed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.model_dir = args.model_dir or str(out / "model")
    build_model_dir(args.preset, Path(args.model_dir))
    workloads = build_workloads(args)
    plan = plan_memory(args, workloads)
    log("memory plan: " + json.dumps(plan))
    tag = gpu_tag()
    json_path, txt_path = out / f"vllm_serve_{tag}.json", out / f"vllm_serve_{tag}.txt"
    deadline = time.monotonic() + args.budget_s
    results: list[dict[str, Any]] = []
    for config in args.configs:
        left = deadline - time.monotonic()
        if left < 30:
            results.append({"config": config, "ok": False, "error": "no time left"})
            continue
        log(f"config {config} ({left:.0f} s left)")
        results.append(run_config(args, config, workloads, plan,
                                  time.monotonic() + min(left - 5, args.config_timeout_s), out))
        json_path.write_text(json.dumps({"benchmark": "vllm_serve", "partial": True,
                                         "args": vars(args), "plan": plan, "configs": results},
                                        indent=2, default=str))
    summary, text = summarize_runs(results, list(workloads))
    header = (f"vllm serve, {args.preset} {args.dtype}, concurrency {args.concurrency}, "
              f"GPU KV {plan['gpu_kv_tokens']} tokens ({plan['gpu_kv_chosen_by']}), host "
              f"{plan['host_gib']} GiB, working sets {plan['working_set_tokens']} tokens, "
              f"kvtier's staging pages {plan['kvtier_staging_bytes'] / 2**20:.0f} MiB "
              f"{'on top' if args.kvtier_extra_gpu else 'out of its GPU KV cache'}, "
              f"{'eager' if args.eager else 'CUDA graphs'}")
    print("\n" + header + "\n" + text)
    failed = [f"{r['config']}: {r.get('error')}" for r in results if not r.get("ok")]
    if failed:
        print("failed: " + "; ".join(failed))
    txt_path.write_text(header + "\n" + text + "\n" + ("failed: " + "; ".join(failed) + "\n"
                                                       if failed else ""))
    from importlib import metadata

    from kvtier.machine import write_report

    versions = {}
    try:
        versions["vllm"] = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        pass
    write_report(json_path, "vllm_serve", {"args": vars(args), "versions": versions,
                                           "plan": plan, "summary": summary,
                                           "configs": results})
    print(f"wrote {json_path} and {txt_path}")


if __name__ == "__main__":
    main()
