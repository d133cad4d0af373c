"""Serving under load: continuous batching against one-at-a-time, kvtier against --no-cache.

Starts two ``kvtier serve`` processes on loopback (``--model``, the tiny default on the CPU by
default; kvtier on, and ``--no-cache``), then, with ``kvtier bench serve``'s load generator:

1. the batching goal: 16 random prompts sent one after another (concurrency 1) and 16 sent at
   once (concurrency 16), on the kvtier server, fresh prompts each (no hits): generated tokens/s
   side by side and their ratio (goal >= 3x);
2. each workload (random, shared-prefix groups, multi-turn from the Mooncake trace scaled to
   16-token blocks) against both servers: TTFT p50/p99, ITL p50/p99, throughput, cached share;
3. the no-hit path's cost under load (``--rounds``): fresh random prompts (no hits possible)
   against both servers in alternating order, a new seed each round, and the median over rounds
   of kvtier's throughput and TTFT p50 over the no-cache server's (a shared machine's drift
   cancels in the alternation, which one pair of runs does not).

Prints the tables, writes ``--json`` (+ .txt) and ``--plot``. Usage (the CPU; the H200)::

    PYTHONPATH=src python benchmarks/serve/serve_load.py --json benchmarks/results/serve_cpu.json \\
        --plot benchmarks/results/serve_cpu.png
    PYTHONPATH=src python benchmarks/serve/serve_load.py --device cuda --model llama3-8b-shape \\
        --scale 8 --json serve_h200.json --plot serve_h200.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

from kvtier.bench import serve_compare
from kvtier.bench.serve_plot import plot_runs
from kvtier.machine import machine_info

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation.jsonl"
BATCH_GOAL = 3.0
#: torch threads per server (``--threads``): on a machine shared with other jobs, one thread per
#: server avoids OpenMP spinning against them (a 16-row step ran 25x slower with 2 threads there).
THREADS = ["1"]
#: Where and what the servers run (``--device``, ``--model``, pools).
SERVER = [["--device", "cpu", "--host.pool_bytes", "64MiB",
           "--host.pinned_budget_bytes", "256MiB"]]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def server(extra: list[str], log: Path) -> Iterator[str]:
    """A ``kvtier serve`` subprocess; yields its base URL once /health answers."""
    port = _free_port()
    cmd = [sys.executable, "-m", "kvtier", "serve", "--port", str(port), *SERVER[0], *extra]
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": THREADS[0]}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            with contextlib.suppress(OSError):
                urllib.request.urlopen(url + "/health", timeout=2).read()
                break
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


#: Prompt lengths multiply by this (``--scale``): 1 on the CPU's tiny model, 8 for an 8B model
#: on the GPU, where 128-token prompts would measure launch overhead only.
SCALE = [1]
TRACE_PATH = [str(TRACE)]


def _args(**kw: object) -> SimpleNamespace:
    scale = SCALE[0]
    base = {"workload": "random", "num_requests": 16, "concurrency": 16, "request_rate": None,
            "input_len": 128 * scale, "output_len": 64, "groups": 4, "prefix_len": 256 * scale,
            "trace": TRACE_PATH[0], "block_tokens": 16, "vocab": 1000, "seed": 0, "api_key": ""}
    base.update(kw)
    return SimpleNamespace(**base)


def warm(url: str) -> None:
    """A few requests first: the first forwards of a process pay one-off costs."""
    args = _args(num_requests=4, concurrency=4, output_len=8, seed=99)
    serve_compare.measure(url, serve_compare.build_workload(args), args)


def batching_goal(url: str) -> dict[str, object]:
    runs = {}
    for name, conc, seed in (("16 sequential", 1, 1), ("16 concurrent", 16, 2)):
        args = _args(concurrency=conc, seed=seed)
        runs[name] = serve_compare.measure(url, serve_compare.build_workload(args), args)
    ratio = runs["16 concurrent"]["output_tokens_per_s"] / runs["16 sequential"]["output_tokens_per_s"]
    return {"runs": runs, "ratio": round(ratio, 2), "goal": BATCH_GOAL, "met": ratio >= BATCH_GOAL}


def workloads() -> dict[str, SimpleNamespace]:
    scale = SCALE[0]
    return {
        "random": _args(seed=3, num_requests=32),
        "shared-prefix": _args(workload="shared-prefix", num_requests=32, input_len=32 * scale,
                               seed=4),
        "multi-turn": _args(workload="multi-turn", num_requests=40, output_len=32,
                            block_tokens=16 * scale),
    }


def no_hit_cost(servers: dict[str, str], off: str, rounds: int) -> dict[str, object]:
    """Each kvtier server in ``servers`` (name: URL) against --no-cache on random prompts, in an
    order that rotates every round; per server, the median over rounds of its ratios."""
    keys = ("output_tokens_per_s", "ttft_ms_p50", "itl_ms_p50")
    ratios = {name: {key: [] for key in keys} for name in servers}
    runs = []
    for r in range(rounds):
        wargs = _args(seed=1000 + r, num_requests=32)
        requests = serve_compare.build_workload(wargs)
        order = [("no-cache", off), *servers.items()]
        order = order[r % len(order):] + order[:r % len(order)]
        got = {name: serve_compare.measure(url, requests, wargs) for name, url in order}
        runs.append(got)
        for name in servers:
            for key in keys:
                if got["no-cache"].get(key) and got[name].get(key):
                    ratios[name][key].append(got[name][key] / got["no-cache"][key])
    median = {name: {key: round(statistics.median(v), 3) for key, v in by.items() if v}
              for name, by in ratios.items()}
    return {"rounds": runs, "ratios": ratios, "median_over_no_cache": median}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--logs", type=Path, default=Path("/tmp"))
    parser.add_argument("--threads", default="1", help="OMP_NUM_THREADS of each server.")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--scale", type=int, default=1, help="Prompt lengths times this.")
    parser.add_argument("--host-pool", default="64MiB")
    parser.add_argument("--pinned-budget", default="256MiB")
    parser.add_argument("--trace", default=str(TRACE), help="The multi-turn workload's trace.")
    parser.add_argument("--rounds", type=int, default=4,
                        help="Alternating rounds of the no-hit cost measurement (0: skip it).")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                        help="Another kvtier server in the no-hit measurement, with these extra "
                             "serve arguments, e.g. 'no-host=--host.pool_bytes 0'.")
    parser.add_argument("--serve-args", default="",
                        help="Extra serve arguments for every server, e.g. "
                             "'--cache.device_memory_fraction 0.12' when several share a GPU.")
    parser.add_argument("--no-hit-only", action="store_true",
                        help="Skip the batching goal and the workloads.")
    args = parser.parse_args()
    THREADS[0], SCALE[0], TRACE_PATH[0] = args.threads, args.scale, args.trace
    SERVER[0] = ["--device", args.device, "--model", args.model, "--dtype", args.dtype,
                 "--host.pool_bytes", args.host_pool,
                 "--host.pinned_budget_bytes", args.pinned_budget, *args.serve_args.split()]
    result: dict[str, object] = {"machine": machine_info(), "server_threads": args.threads,
                                 "server_args": SERVER[0], "scale": args.scale}
    tables = []
    with contextlib.ExitStack() as stack:
        on = stack.enter_context(server([], args.logs / "kvtier_serve_on.log"))
        off = stack.enter_context(server(["--no-cache"], args.logs / "kvtier_serve_off.log"))
        variants = {"kvtier": on}
        for spec in args.variant:
            name, extra = spec.split("=", 1)
            variants[name] = stack.enter_context(
                server(extra.split(), args.logs / f"kvtier_serve_{name}.log"))
        for url in (*variants.values(), off):
            warm(url)
        if not args.no_hit_only:
            goal = batching_goal(on)
            result["batching"] = goal
            tables.append(f"## batching (kvtier server, random {128 * SCALE[0]}-token prompts, "
                          f"64 new tokens)\n{serve_compare.table(goal['runs'])}\nratio "
                          f"{goal['ratio']}x (goal >= {BATCH_GOAL}x: "
                          f"{'met' if goal['met'] else 'NOT met'})")
            for name, wargs in workloads().items():
                requests = serve_compare.build_workload(wargs)
                runs = {"kvtier": serve_compare.measure(on, requests, wargs),
                        "no-cache": serve_compare.measure(off, requests, wargs)}
                result[name] = {"settings": serve_compare.settings(wargs), "runs": runs}
                tables.append(f"## {name} {serve_compare.settings(wargs)}\n{serve_compare.table(runs)}")
        if args.rounds:
            cost = no_hit_cost(variants, off, args.rounds)
            result["no_hit_cost"] = cost | {"variants": args.variant}
            lines = [f"{name}: {m}" for name, m in cost["median_over_no_cache"].items()]
            tables.append(f"## no-hit cost, {args.rounds} rotating rounds of 32 random prompts, "
                          "median of each server over --no-cache\n" + "\n".join(lines))
    text = "\n\n".join(tables)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        args.json.with_suffix(".txt").write_text(text + "\n")
    if args.plot and not args.no_hit_only:
        flat = {**{k: v for k, v in goal["runs"].items()},
                **{f"{w} {s}": r for w in workloads() for s, r in result[w]["runs"].items()}}
        plot_runs(flat, args.plot, title=f"kvtier bench serve, {args.device}, {args.model}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
