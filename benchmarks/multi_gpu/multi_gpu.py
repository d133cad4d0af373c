"""Tensor-parallel ranks share layout-neutral pages through one ``file://`` store.

For each writer world size N (``--world 2 4``), in one run:

1. TP=N ranks (one process each) prefill the prompts of a random-weight model with 8 KV heads
   split across them and store their head groups through ``TieredCache(heads=...)``;
2. a TP=1 process and a TP=N' process (N' = 4 for N = 2, else 2) load every prompt from that
   store, all ranks at once: each rank's loaded KV must be byte-identical to its slice of a TP=1
   prefill, and the greedy tokens after the loaded prefix (slices all-gathered) must match a cold
   TP=1 run (fp32); per rank, the load rate of its slice against the device's own copy rate of
   the same bytes measured right after (CPU: memcpy; CUDA: pinned host -> device);
3. TP=N ranks whose local hits differ (the last rank's tiers cleared, half refilled) must agree
   on the half through ``torch.distributed``; then the last rank dies between a match and its
   load, and the others must fail within the process-group timeout instead of hanging.

Ranks are spawned processes with torchrun-style env (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*),
NCCL_NVLS_ENABLE=0, started by ``spawn`` (CUDA needs it; with gloo ``--start-method fork`` saves
the imports). Writes ``<name>.json`` and ``<name>.txt`` under --out.
CPU: ``PYTHONPATH=src python benchmarks/multi_gpu/multi_gpu.py --backend gloo --world 2 4``.
GPUs: see docs/architecture.md, "Ranks".
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.machine import format_table, write_report
from multi_gpu_ranks import rank_main

PHASE_MARGIN_S = 120.0  # per phase, on top of the process-group timeout: spawn and imports


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_world(phase: str, opts: dict[str, Any], world: int) -> dict[str, Any]:
    """Spawn ``world`` rank processes for ``phase``; wait for them within a bound; collect."""
    out_dir = Path(tempfile.mkdtemp(prefix=f"{phase}-w{world}-", dir=opts["work_dir"]))
    run_opts = {**opts, "out_dir": str(out_dir)}
    ctx = multiprocessing.get_context(opts["start_method"])
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(phase, run_opts, r, world, port))
             for r in range(world)]
    start = time.perf_counter()
    for proc in procs:
        proc.start()
    deadline = start + opts["pg_timeout_s"] + PHASE_MARGIN_S
    exited: dict[int, float] = {}
    while len(exited) < world and time.perf_counter() < deadline:
        for r, proc in enumerate(procs):
            if r not in exited and not proc.is_alive():
                exited[r] = time.perf_counter() - start
        time.sleep(0.05)
    hung = [r for r, proc in enumerate(procs) if proc.is_alive()]
    for r in hung:
        procs[r].kill()
    for proc in procs:
        proc.join(10)
    ranks = []
    for r in range(world):
        result = out_dir / f"rank{r}.json"
        error = out_dir / f"rank{r}.error"
        ranks.append(json.loads(result.read_text()) if result.exists()
                     else {"rank": r, "error": error.read_text() if error.exists() else "no result"})
    return {"phase": phase, "world": world, "wall_s": time.perf_counter() - start, "hung": hung,
            "exit_s": [exited.get(r) for r in range(world)],
            "exitcodes": [proc.exitcode for proc in procs], "ranks": ranks}


def reader_worlds(writer: int, readers: list[int] | None) -> list[int]:
    """TP=1 and TP=N' (4 for a writer of 2, else 2), or the ``--readers`` given."""
    return readers if readers else [1, 4 if writer == 2 else 2]


def run_experiment(opts: dict[str, Any], writer: int) -> dict[str, Any]:
    """The three steps of the module docstring for writer world ``writer``; one fresh store."""
    store = tempfile.mkdtemp(prefix=f"store-w{writer}-", dir=opts["work_dir"])
    opts = {**opts, "store_dir": store}
    runs = [run_world("write", opts, writer)]
    runs += [run_world("read", opts, world) for world in reader_worlds(writer, opts.get("readers"))]
    runs.append(run_world("agree", opts, writer))
    return {"writer_world": writer, "runs": runs, "checks": checks(runs, opts)}


def checks(runs: list[dict[str, Any]], opts: dict[str, Any]) -> dict[str, Any]:
    """Pass/fail of each goal, from the ranks' own reports."""
    write, *reads, agree = runs
    full = opts["prompt_tokens"] // opts["page_size"] * opts["page_size"]
    prompts = [p for run in reads for rank in run["ranks"] for p in rank.get("prompts", [])]
    expected_prompts = opts["prompts"] * sum(run["world"] for run in reads)
    ranks = agree["ranks"]
    survivors, last = ranks[:-1], ranks[-1]
    half = opts["prompt_tokens"] // opts["page_size"] // 2 * opts["page_size"]
    bound = opts["pg_timeout_s"] + PHASE_MARGIN_S
    return {
        "written": all("written_pages" in r and r.get("drained") for r in write["ranks"]),
        "loaded_full": len(prompts) == expected_prompts
        and all(p["hit_tokens"] == full for p in prompts),
        "kv_identical": len(prompts) == expected_prompts and all(p["kv_identical"] for p in prompts),
        "greedy_match": len(prompts) == expected_prompts and all(p["greedy_match"] for p in prompts),
        "agreed_on_min": all(r.get("hit_tokens") == r.get("loaded_tokens") == half
                             for r in ranks) and len({r.get("calls") for r in ranks}) == 1,
        # a survivor either reports the failed collective or was ended by its backend (NCCL's
        # watchdog tears a rank down at the process-group timeout); none may hang
        "killed_rank_bounded": not agree["hung"] and bool(survivors) and "hit_tokens" in last
        and all(s is not None and s < bound for s in agree["exit_s"])
        and all(r.get("after_kill", "returned") != "returned" or code != 0
                for r, code in zip(survivors, agree["exitcodes"], strict=False)),
    }


def table(results: list[dict[str, Any]]) -> str:
    rows = []
    for result in results:
        for run in result["runs"]:
            for rank in run["ranks"]:
                if run["phase"] == "read" and "load_gbs" in rank:
                    share = rank["load_gbs"] / rank["copy_peak_gbs"]
                    rows.append([result["writer_world"], f"read TP={run['world']}", rank["rank"],
                                 "-".join(map(str, rank["heads"])), rank["loaded_bytes"],
                                 rank["load_gbs"], rank["copy_peak_gbs"], share])
    lines = [format_table(["writer TP", "phase", "rank", "heads", "bytes", "load GB/s",
                           "copy peak GB/s", "load/peak"], rows), ""]
    for result in results:
        checks_ = ", ".join(f"{k}={'ok' if v else 'FAIL'}" for k, v in result["checks"].items())
        agree = result["runs"][-1]
        times = ", ".join(f"{r.get('after_kill_s', float('nan')):.2f}" for r in agree["ranks"][:-1])
        lines.append(f"writer TP={result['writer_world']}: {checks_}; survivors failed after "
                     f"[{times}] s (process-group timeout {result['opts_pg_timeout_s']} s)")
    return "\n".join(lines)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--world", type=int, nargs="+", default=[2], help="writer TP sizes")
    ap.add_argument("--readers", type=int, nargs="+", default=None,
                    help="reader TP sizes (default: 1 and 4 for a writer of 2, else 1 and 2)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--greedy-tokens", type=int, default=8)
    ap.add_argument("--pg-timeout-s", type=float, default=20.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-method", choices=("spawn", "fork"), default="spawn")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default=None, help="result file stem (multi_gpu_cpu / _gpu)")
    return ap.parse_args()


def options(args: argparse.Namespace, work_dir: str) -> dict[str, Any]:
    if args.backend == "nccl" and args.start_method != "spawn":
        raise SystemExit("--start-method fork cannot start CUDA ranks: use spawn with nccl")
    worlds = set(args.world).union(*(reader_worlds(w, args.readers) for w in args.world))
    for world in sorted(worlds):
        if 8 % world:
            raise SystemExit(f"TP={world} does not split the model's 8 KV heads (--world/--readers)")
    if args.backend == "nccl":
        import torch

        if max(worlds) > torch.cuda.device_count():
            raise SystemExit(f"TP={max(worlds)} needs {max(worlds)} GPUs, this machine has "
                             f"{torch.cuda.device_count()} (--world/--readers)")
    if args.prompt_tokens % args.page_size == 0:
        raise SystemExit("--prompt-tokens must leave a partial last page (a suffix to run)")
    return {"backend": args.backend, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
            "page_size": args.page_size, "greedy_tokens": args.greedy_tokens,
            "pg_timeout_s": args.pg_timeout_s, "threads": args.threads, "seed": args.seed,
            "start_method": args.start_method, "readers": args.readers,
            "work_dir": work_dir,
            "shape": {"layers": args.layers, "hidden": args.hidden, "kv_heads": 8,
                      "head_dim": args.head_dim, "mlp": 2 * args.hidden}}


def main() -> None:
    args = parse()
    name = args.name or ("multi_gpu_gpu" if args.backend == "nccl" else "multi_gpu_cpu")
    with tempfile.TemporaryDirectory(prefix="kvtier-multi-gpu-") as work:
        opts = options(args, work)
        results = [{**run_experiment(opts, world), "opts_pg_timeout_s": args.pg_timeout_s}
                   for world in args.world]
    text = table(results)
    print(text)
    out = Path(args.out)
    write_report(out / f"{name}.json", "multi_gpu",
                 {"command": sys.argv, "options": {k: v for k, v in opts.items() if k != "work_dir"},
                  "results": results})
    (out / f"{name}.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
