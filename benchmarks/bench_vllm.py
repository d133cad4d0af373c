"""TTFT of a repeated long prefix in vLLM (CPU backend) with and without kvtier's connector.

Runs inside ``.venv-vllm`` (``bash scripts/setup_vllm_env.sh``)::

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--prompts 6] [--tokens 1536]

Three vLLM engine processes, one after the other, on a random-weight Llama built locally
(8 layers, 512 wide, 8 KV heads of 64; no download), greedy, one output token per request so a
request's wall time is its TTFT:

1. vLLM alone, its prefix cache on: distinct prompts (recompute), then the same prompts again
   (vLLM's own prefix-cache hit);
2. vLLM with the connector (disk tier), its own prefix cache off: other distinct prompts, two
   on the miss path (each is stored after its step, on the connector's saver thread) then two
   opted out of kvtier (``kv_transfer_params={"kvtier_cache": False}``: plain recompute in the
   same process) and so on; a wait until the saves and their disk writes are done; then the
   stored prompts again (served from kvtier's staging and host tiers);
3. a fresh vLLM process with the connector on the same disk tier, its prefix cache off: the
   prompts of run 2 (served from kvtier's disk tier, read back through the page cache).

Each process first runs one warm-up prompt that is not counted. Reports medians per case; the
miss-path overhead as stored misses against the opted-out requests interleaved with them
(requests back to back, so a save still running when the next request starts competes with it;
the interleaving cancels the drift of a shared machine's load, which separate processes do not,
but background work a save leaves behind slows both groups alike, so only the comparison with
vLLM alone includes it); the write path's cost per stored request: the process CPU time of
the mixed step and of the wait after it, less the opted-out requests' median per request
(every thread: saver, IO, OpenMP), and the saver thread's own CPU time in its layer copies and
commits (from the connector's counters). The load average is recorded before and after: on a
shared machine it says how far to trust the times. Writes ``benchmarks/results/vllm_cpu.json``
and ``.txt``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests" / "vllm_suite"))

from vllm_helpers import build_model, prompts, run_scenario  # noqa: E402

from kvtier.machine import format_table, write_report  # noqa: E402

MODEL_SHAPE = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
               "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64}
RESULTS = ROOT / "benchmarks" / "results"


#: Seconds the benchmark waits for the connector's saves to reach the disk tier.
DRAIN_S = 300.0


def _steps(warmup: list[int], *groups: list[dict[str, Any]] | str) -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = [{"prompts": [{"tokens": warmup}], "max_tokens": 1},
                                   {"action": {"drain_connector": DRAIN_S}}]
    for group in groups:
        steps.append({"action": {"drain_connector": DRAIN_S}} if group == "drain" else
                     {"prompts": group, "max_tokens": 1})
    return steps


def _plain(group: list[list[int]]) -> list[dict[str, Any]]:
    return [{"tokens": p} for p in group]


def _interleaved(on: list[list[int]], off: list[list[int]]) -> list[dict[str, Any]]:
    """Two stored, two opted out, and so on: a save still running when the next request starts
    lands as often on a stored request as on an opted-out one."""
    out: list[dict[str, Any]] = []
    for i in range(0, len(on), 2):
        out += [{"tokens": p} for p in on[i:i + 2]]
        out += [{"tokens": p, "kvtier_off": True} for p in off[i:i + 2]]
    return out


def _median_ms(results: list[dict[str, Any]]) -> float:
    return statistics.median(r["seconds"] for r in results) * 1e3


def run(n_prompts: int, tokens: int, work: Path) -> dict[str, Any]:
    model = build_model(work / "model", **MODEL_SHAPE)
    base = {"model": str(model), "max_model_len": tokens + 64, "block_size": 128,
            "kv_cache_memory_bytes": 512 << 20}
    first, second = prompts(n_prompts, tokens, seed=1), prompts(n_prompts, tokens, seed=2)
    opted_out, warm = prompts(n_prompts, tokens, seed=4), prompts(3, tokens, seed=3)
    tiers = {"disk_url": f"file://{work / 'disk'}", "host_pool_bytes": "512MiB",
             "staging_pages": 64}
    load_before = os.getloadavg()
    alone = run_scenario(dict(base, connector=None, steps=_steps(
        warm[0], _plain(first), _plain(first))), work)
    stored = run_scenario(dict(base, connector=tiers, prefix_caching=False, steps=_steps(
        warm[1], _interleaved(second, opted_out), "drain", _plain(second))), work)
    fresh = run_scenario(dict(base, connector=tiers, prefix_caching=False,
                              steps=_steps(warm[2], _plain(second))), work)
    mixed = stored["steps"][1]
    misses = [r for r in mixed if not r["kvtier_off"]]
    baseline = [r for r in mixed if r["kvtier_off"]]
    cases = {
        "recompute (vLLM alone, cold)": alone["steps"][1],
        "vLLM prefix-cache hit": alone["steps"][2],
        "recompute, request opted out of kvtier": baseline,
        "kvtier miss + store": misses,
        "kvtier host hit": stored["steps"][2],
        "kvtier disk hit (fresh process)": fresh["steps"][1],
    }
    counts = stored["connector"]
    saves = max(1, counts.get("saved_tokens", 0) // (tokens // 128 * 128))   # warm-up included
    step_cpu = sum(r["cpu_seconds"] for r in mixed) + stored["actions"][1]["cpu_seconds"]
    baseline_cpu = statistics.median(r["cpu_seconds"] for r in baseline)
    return {
        "prompts": n_prompts, "prompt_tokens": tokens, "model_shape": MODEL_SHAPE,
        "cases": {name: {"ttft_ms_median": _median_ms(r),
                         "cached_tokens": [x["num_cached_tokens"] for x in r],
                         "computed_tokens": [x["computed_tokens"] for x in r],
                         "ttft_ms": [x["seconds"] * 1e3 for x in r]}
                  for name, r in cases.items()},
        "miss_path_overhead": _median_ms(misses) / _median_ms(baseline) - 1,
        "miss_path_overhead_vs_vllm_alone": _median_ms(misses) / _median_ms(alone["steps"][1]) - 1,
        "write_path_cpu_ms_per_request": (step_cpu - baseline_cpu * len(mixed)) * 1e3 / len(misses),
        "saver_cpu_ms_per_request": {
            "copies": counts.get("save_copy_cpu_us", 0) / 1e3 / saves,
            "commits": counts.get("save_commit_cpu_us", 0) / 1e3 / saves},
        "saves_drained": [a["done"] for a in stored["actions"]],
        "drain_seconds_after_miss_step": stored["actions"][1]["seconds"],
        "load_average_before_after": [load_before, os.getloadavg()],
        "connector_counters": {"store_run": counts, "fresh_run": fresh["connector"]},
        "engine_start_s": [alone["load_seconds"], stored["load_seconds"], fresh["load_seconds"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6, help="per case (even)")
    parser.add_argument("--tokens", type=int, default=1536)
    parser.add_argument("--out", default=str(RESULTS / "vllm_cpu.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-vllm-") as tmp:
        data = run(args.prompts, args.tokens, Path(tmp))
    rows = [[name, case["ttft_ms_median"], statistics.mean(case["cached_tokens"]),
             statistics.mean(case["computed_tokens"])] for name, case in data["cases"].items()]
    table = format_table(["case", "TTFT ms (median)", "cached tokens", "computed tokens"], rows)
    saver = data["saver_cpu_ms_per_request"]
    summary = (f"{table}\n\nmiss-path overhead (miss + store vs opted-out requests, "
               f"interleaved in one process): {data['miss_path_overhead'] * 100:+.1f}%\n"
               f"miss-path overhead against vLLM alone (another process): "
               f"{data['miss_path_overhead_vs_vllm_alone'] * 100:+.1f}%\n"
               f"write path, process CPU per stored request (all threads, vs opted out): "
               f"{data['write_path_cpu_ms_per_request']:.0f} ms\n"
               f"saver thread CPU per stored request: copies {saver['copies']:.0f} ms, "
               f"commits {saver['commits']:.0f} ms\n"
               f"saves still running after the miss step: "
               f"{data['drain_seconds_after_miss_step']:.2f} s until drained\n"
               f"load average before / after: {data['load_average_before_after']}\n")
    print(summary)
    out = write_report(args.out, "bench_vllm", data)
    out.with_suffix(".txt").write_text(summary)


if __name__ == "__main__":
    main()
