"""Where a recompute's GPU time goes in kvtier's engine: one prompt's prefill under
``torch.profiler``, its kernels grouped (matmuls, attention, norms, rotary, element-wise,
copies, other), with the library kernels and with the deterministic ones.

For each ``--modes`` entry and each ``--lengths`` entry: fresh prompts (no cache hit) go
through ``EngineService`` with one new token; the median TTFT of ``--repeats`` is timed first,
then one more prompt runs under the profiler. Prints a table a (mode, length) and writes
``prefill_profile.json`` (with the machine's facts) under ``--out``. Main thread; the engine
runs on its own thread, as in ``kvtier serve`` (the profiler sees every thread's kernels).

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
             "cache.device_memory_fraction": "0.5"}
    service = EngineService.build(build_config(env={}, flags=flags), lm=lm)
    vocab = int(lm.config.vocab_size)
    seed = iter(range(1, 1 << 30))

    def one(n: int) -> float:
        started = time.perf_counter()
        service.submit(GenerationRequest(tuple(tokens(n, next(seed), vocab)), 1)).result(timeout=600)
        return time.perf_counter() - started

    rows = []
    try:
        one(64)   # warm-up: kernels compiled, graphs captured
        for n in args.lengths:
            one(n)
            ttft = statistics.median(one(n) for _ in range(args.repeats))
            cuda = torch.cuda.is_available() and args.device.startswith("cuda")
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as prof:
                one(n)
            by_group: dict[str, float] = {}
            kernels: dict[str, list[float]] = {}
            for evt in prof.key_averages():
                us = float(getattr(evt, "device_time_total", 0.0) if cuda
                           else getattr(evt, "self_cpu_time_total", 0.0))
                if us <= 0 or (cuda and getattr(evt, "device_type", None) is not None
                               and str(evt.device_type).endswith("CPU")):
                    continue
                if not cuda and not evt.key.startswith("aten::"):
                    continue
                by_group[group_of(evt.key)] = by_group.get(group_of(evt.key), 0.0) + us
                kernels[evt.key] = [us, float(evt.count)]
            total = sum(by_group.values())
            top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[: args.top]
            rows.append({"mode": "deterministic" if deterministic else "library", "tokens": n,
                         "ttft_ms": round(ttft * 1e3, 2), "gpu_ms": round(total / 1e3, 2),
                         "groups_ms": {g: round(v / 1e3, 2) for g, v in
                                       sorted(by_group.items(), key=lambda kv: -kv[1])},
                         "top": [{"kernel": k[:120], "ms": round(v[0] / 1e3, 3),
                                  "calls": int(v[1])} for k, v in top]})
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
    args = p.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    rows: list[dict[str, Any]] = []
    for mode in args.modes.split(","):
        rows += run_mode(args, deterministic=mode == "deterministic")
    groups = sorted({g for r in rows for g in r["groups_ms"]})
    print(format_table(["mode", "tokens", "TTFT ms", "GPU ms", *groups],
                       [[r["mode"], r["tokens"], r["ttft_ms"], r["gpu_ms"],
                         *(r["groups_ms"].get(g, 0.0) for g in groups)] for r in rows]))
    for r in rows:
        print(f"\n{r['mode']}, {r['tokens']} tokens: top kernels")
        print(format_table(["ms", "calls", "kernel"],
                           [[t["ms"], t["calls"], t["kernel"]] for t in r["top"]]))
    path = write_report(Path(args.out) / "prefill_profile.json", "prefill_profile",
                        {"args": {k: v for k, v in vars(args).items()}, "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
