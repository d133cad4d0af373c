"""Where kvtier's engine spends its GPU time: one prompt's prefill and one decode step under
``torch.profiler``, their kernels grouped (matmuls, attention, norms, rotary, element-wise,
copies, other) and counted, with the library kernels and with the deterministic ones.

For each ``--modes`` entry and each ``--lengths`` entry: fresh prompts (no cache hit) go
through ``EngineService`` with one new token; the median TTFT of ``--repeats`` is timed first,
then one more prompt runs under the profiler. For each ``--decode-batches`` entry: that many
fresh prompts at once, profiled once with one new token each and once with
``--decode-steps`` more; the difference over the steps is one decode step (its kernels and
their time, and the inter-token latency), and the same difference under ``cProfile`` on the
engine thread gives the step's Python (``--python-top``: the host's share of the latency).
Prints a table a row and writes ``prefill_profile.json`` (with the machine's facts) under
``--out``. Main thread; the engine runs on its own thread, as in ``kvtier serve`` (the profiler
sees every thread's kernels).

    PYTHONPATH=src python3 benchmarks/engine/prefill_profile.py --out /tmp/pp
    PYTHONPATH=src python3 benchmarks/engine/prefill_profile.py --device cpu --preset tiny-llama \\
        --lengths 64 --repeats 1 --out /tmp/pp       # a dry run of the script
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import time
from pathlib import Path
from typing import Any

#: Kernel groups, first match wins (names of CUDA kernels as the profiler reports them).
GROUPS = (
    ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|_fused_kernel|_segment_kernel|"
                          r"_sum_segments|matmul", re.I)),
    ("attention", re.compile(r"attn|attention|flash|paged|_prefill|fmha", re.I)),
    ("norm", re.compile(r"rms|norm", re.I)),
    ("rotary", re.compile(r"rotary|rope", re.I)),
    ("copy", re.compile(r"copy|memcpy|memset|cat|gather|scatter|index", re.I)),
    ("element-wise", re.compile(r"elementwise|vectorized|silu|mul|add|reduce", re.I)),
)


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if pattern.search(name):
            return group
    return "other"


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed * 7919 + n)
    return [rng.randrange(5, min(vocab, 1000)) for _ in range(n)]


def kernel_times(prof: Any, cuda: bool) -> dict[str, tuple[float, int]]:
    """Each kernel's (microseconds, calls) in a profile (aten ops on the CPU, where the engine
    thread's kernels are not recorded)."""
    out: dict[str, tuple[float, int]] = {}
    for evt in prof.key_averages():
        us = float(getattr(evt, "device_time_total", 0.0) if cuda
                   else getattr(evt, "self_cpu_time_total", 0.0))
        if us <= 0 or (cuda and getattr(evt, "device_type", None) is not None
                       and str(evt.device_type).endswith("CPU")):
            continue
        if not cuda and not evt.key.startswith("aten::"):
            continue
        out[evt.key] = (us, int(evt.count))
    return out


def summary_row(times: dict[str, tuple[float, float]], top: int) -> dict[str, Any]:
    """Group totals (ms), the kernel count and the top kernels of ``times``."""
    groups: dict[str, float] = {}
    for name, (us, _) in times.items():
        groups[group_of(name)] = groups.get(group_of(name), 0.0) + us
    ranked = sorted(times.items(), key=lambda kv: -kv[1][0])[:top]
    return {"gpu_ms": round(sum(groups.values()) / 1e3, 3),
            "kernels": round(sum(calls for _, calls in times.values()), 1),
            "groups_ms": {g: round(v / 1e3, 3) for g, v in sorted(groups.items(),
                                                                 key=lambda kv: -kv[1])},
            "top": [{"kernel": k[:120], "ms": round(v[0] / 1e3, 3), "calls": round(v[1], 1)}
                    for k, v in ranked]}


def step_difference(whole: dict[str, tuple[float, int]], first: dict[str, tuple[float, int]],
                    steps: int) -> dict[str, tuple[float, float]]:
    """One decode step's (time, calls) per name: the run with ``steps`` more tokens less the
    run with none, over ``steps``."""
    return {k: ((us - first.get(k, (0.0, 0))[0]) / steps,
                (calls - first.get(k, (0.0, 0))[1]) / steps) for k, (us, calls) in whole.items()}


def python_times(prof: Any) -> dict[str, tuple[float, int]]:
    """Each Python function's own time (microseconds) and calls in a ``cProfile`` run."""
    import pstats

    out: dict[str, tuple[float, int]] = {}
    for (path, line, name), (_, calls, own, _, _) in pstats.Stats(prof).stats.items():
        where = f"{Path(path).name}:{line}({name})" if path != "~" else name
        out[where] = (own * 1e6, int(calls))
    return out


def python_per_step(args: argparse.Namespace, service: Any, run: Any,
                    batch: int) -> list[dict[str, Any]]:
    """The engine thread's Python per decode step (``cProfile`` on that thread, the run with
    ``--decode-steps`` more tokens less the run with none): where the host's share of the
    inter-token latency goes, CUDA calls that wait (a sync, a copy) included. The profiler
    slows Python down, so the times are an upper bound; their ranking is the point."""
    import cProfile

    def profiled(new: int) -> dict[str, tuple[float, int]]:
        prof = cProfile.Profile()
        service.scheduler.call_soon(prof.enable).result(timeout=60)
        try:
            run(args.decode_prompt, batch, new)
        finally:
            service.scheduler.call_soon(prof.disable).result(timeout=60)
        return python_times(prof)

    per_step = step_difference(profiled(1 + args.decode_steps), profiled(1), args.decode_steps)
    ranked = sorted(per_step.items(), key=lambda kv: -kv[1][0])[:args.python_top]
    return [{"function": k[:100], "us": round(us, 1), "calls": round(calls, 2)}
            for k, (us, calls) in ranked if us > 0]


def run_mode(args: argparse.Namespace, deterministic: bool) -> list[dict[str, Any]]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvtier.config import build_config
    from kvtier.engine.hf import load_model
    from kvtier.engine.request import GenerationRequest
    from kvtier.engine.service import EngineService

    lm = load_model(args.preset, device=args.device, dtype=args.dtype, deterministic=deterministic)
    flags = {"engine.model": args.preset, "engine.device": args.device, "engine.dtype": args.dtype,
             "engine.deterministic": str(deterministic).lower(), "host.pool_bytes": "1GiB",
             "cache.device_memory_fraction": "0.5",
             "engine.max_running": str(max(args.decode_batches or [1]))}
    service = EngineService.build(build_config(env={}, flags=flags), lm=lm)
    vocab = int(lm.config.vocab_size)
    seed = iter(range(1, 1 << 30))
    cuda = torch.cuda.is_available() and args.device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    mode = "deterministic" if deterministic else "library"

    def run(n: int, batch: int = 1, new: int = 1) -> float:
        """``batch`` fresh prompts of ``n`` tokens at once, ``new`` tokens each: wall seconds."""
        started = time.perf_counter()
        handles = [service.submit(GenerationRequest(tuple(tokens(n, next(seed), vocab)), new))
                   for _ in range(batch)]
        for handle in handles:
            handle.result(timeout=600)
        return time.perf_counter() - started

    def profiled(*a: int) -> tuple[float, dict[str, tuple[float, int]]]:
        with profile(activities=acts) as prof:
            wall = run(*a)
        return wall, kernel_times(prof, cuda)

    rows = []
    try:
        run(64)   # warm-up: kernels compiled, graphs captured
        for n in args.lengths:
            run(n)
            ttft = statistics.median(run(n) for _ in range(args.repeats))
            _, times = profiled(n)
            rows.append({"mode": mode, "kind": "prefill", "tokens": n,
                         "ttft_ms": round(ttft * 1e3, 2), **summary_row(
                             {k: (us, float(c)) for k, (us, c) in times.items()}, args.top)})
        steps = args.decode_steps
        for batch in args.decode_batches:
            run(args.decode_prompt, batch, 1 + steps)            # warm-up: this batch's graphs
            wall_1, first = profiled(args.decode_prompt, batch, 1)
            wall_n, whole = profiled(args.decode_prompt, batch, 1 + steps)
            per_step = {k: v for k, v in step_difference(whole, first, steps).items()
                        if v[0] > 0}
            row = {"mode": mode, "kind": "decode step", "tokens": args.decode_prompt,
                   "batch": batch, "itl_ms": round((wall_n - wall_1) / steps * 1e3, 3),
                   **summary_row(per_step, args.top)}
            if args.python_top:
                row["python_top"] = python_per_step(args, service, run, batch)
            rows.append(row)
    finally:
        service.close()
        del lm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    from kvtier.machine import format_table, write_report

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default="llama3-8b-shape")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--modes", default="library,deterministic")
    p.add_argument("--lengths", default="4096,32768")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top", type=int, default=12, help="kernels listed a row")
    p.add_argument("--decode-batches", default="1,16",
                   help="decode steps profiled at these batch sizes ('' for none)")
    p.add_argument("--decode-prompt", type=int, default=2048, help="prompt tokens of each")
    p.add_argument("--decode-steps", type=int, default=32, help="tokens the profiled run adds")
    p.add_argument("--python-top", type=int, default=15,
                   help="the engine thread's Python functions listed a decode step (0: none)")
    args = p.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    args.decode_batches = [int(x) for x in args.decode_batches.split(",") if x]
    rows: list[dict[str, Any]] = []
    for mode in args.modes.split(","):
        rows += run_mode(args, deterministic=mode == "deterministic")
    groups = sorted({g for r in rows for g in r["groups_ms"]})
    print(format_table(["mode", "what", "tokens", "batch", "TTFT/ITL ms", "GPU ms", "kernels",
                        *groups],
                       [[r["mode"], r["kind"], r["tokens"], r.get("batch", 1),
                         r.get("ttft_ms", r.get("itl_ms")), r["gpu_ms"], r["kernels"],
                         *(r["groups_ms"].get(g, 0.0) for g in groups)] for r in rows]))
    for r in rows:
        print(f"\n{r['mode']}, {r['kind']}, {r['tokens']} tokens, batch {r.get('batch', 1)}: "
              "top kernels")
        print(format_table(["ms", "calls", "kernel"],
                           [[t["ms"], t["calls"], t["kernel"]] for t in r["top"]]))
        if r.get("python_top"):
            print(f"\n{r['mode']}, decode step, batch {r.get('batch', 1)}: the engine "
                  "thread's Python a step (cProfile, own time)")
            print(format_table(["us", "calls", "function"],
                               [[t["us"], t["calls"], t["function"]] for t in r["python_top"]]))
    path = write_report(Path(args.out) / "prefill_profile.json", "prefill_profile",
                        {"args": {k: v for k, v in vars(args).items()}, "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
