"""TTFT of a repeated long prefix in vLLM (CPU backend) with and without kvtier's connector.

Runs inside ``.venv-vllm`` (``bash scripts/setup_vllm_env.sh``)::

    .venv-vllm/bin/python benchmarks/vllm/bench_vllm.py [--prompts 6] [--tokens 1536]

Fresh vLLM engine processes, one after the other, on a random-weight Llama built locally
(8 layers, 512 wide, 8 KV heads of 64; no download), greedy, one output token per request so a
request's wall time is its TTFT:

1. vLLM alone, its prefix cache on: distinct prompts, then the same prompts again (vLLM's own
   prefix-cache hit);
2. ``--rounds`` rounds of three processes on the round's own distinct prompts, prefix caches
   off, in an order that rotates from round to round: vLLM alone (recompute); vLLM with a KV
   connector that does nothing (``tests/vllm_suite/noop_connector.py``: what vLLM itself adds
   for having any connector); vLLM with kvtier's connector (disk tier), two prompts on the miss
   path (each stored after its step, on the connector's saver thread), then two opted out of
   kvtier (``kv_transfer_params={"kvtier_cache": False}``) and so on, a wait until the saves
   and their disk writes are done, then the stored prompts again (kvtier's host tier);
3. a fresh process with kvtier on the first round's disk tier: its prompts again (kvtier's disk
   tier, read back through the page cache).

Each process first runs one warm-up prompt that is not counted. Reports medians per case and,
per round, the TTFT ratios of stored misses to vLLM alone, to the no-op connector and to the
opted-out requests of the same process, with the no-op connector's ratio to vLLM alone; then
the median ratio over the rounds and its spread. Separate processes do not cancel the drift of
a shared machine's load, so one pair of processes says little; the rounds, in rotated order,
say how far a ratio moves. The comparison with opted-out requests interleaved in one process
cancels drift, but background work a save leaves behind slows both groups alike, so only the
comparisons with other processes include it. The write path's cost per stored request: the
process CPU time of the mixed step and of the wait after it, less the opted-out requests'
median per request (every thread: saver, IO, OpenMP; on a loaded machine the noise of the
forward's own CPU time swamps it), the CPU time of kvtier's own threads (saver and IO workers,
by name: robust to that noise), and the saver thread's CPU time in its layer copies and
commits (from the connector's counters); ``benchmarks/vllm/vllm_write_path.py``
splits it by thread without vLLM. The load average is recorded before and after: on a shared
machine it says how far to trust the times. Writes ``benchmarks/results/vllm_cpu.json`` and
``.txt``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
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


def _round(base: dict[str, Any], tiers: dict[str, Any], n_prompts: int, tokens: int, r: int,
           work: Path) -> dict[str, Any]:
    """One round of fresh processes on distinct prompts: vLLM alone, vLLM with the no-op
    connector, vLLM with kvtier (stored misses interleaved with opted-out requests); the order
    rotates from round to round, so a drift of the machine's load lands on each alike."""
    warm, own = prompts(1, tokens, seed=10 + 10 * r)[0], _own(n_prompts, tokens, r)
    opted_out = prompts(n_prompts, tokens, seed=12 + 10 * r)
    specs = {
        "alone": dict(base, connector=None, prefix_caching=False,
                      steps=_steps(warm, _plain(own))),
        "noop": dict(base, connector="noop", prefix_caching=False,
                     steps=_steps(warm, _plain(own))),
        "kvtier": dict(base, connector=dict(tiers, disk_url=f"file://{work / f'disk-{r}'}"),
                       prefix_caching=False,
                       steps=_steps(warm, _interleaved(own, opted_out), "drain", _plain(own))),
    }
    order = list(specs)[r % 3:] + list(specs)[:r % 3]
    runs = {name: run_scenario(specs[name], work) for name in order}
    misses = [x for x in runs["kvtier"]["steps"][1] if not x["kvtier_off"]]
    offs = [x for x in runs["kvtier"]["steps"][1] if x["kvtier_off"]]
    alone, noop = runs["alone"]["steps"][1], runs["noop"]["steps"][1]
    return {"order": order, "runs": runs, "alone": alone, "noop": noop, "misses": misses,
            "opted_out": offs,
            "ratios": {"kvtier miss / vLLM alone": _median_ms(misses) / _median_ms(alone),
                       "no-op connector / vLLM alone": _median_ms(noop) / _median_ms(alone),
                       "kvtier miss / no-op connector": _median_ms(misses) / _median_ms(noop),
                       "kvtier miss / opted out (same process)":
                           _median_ms(misses) / _median_ms(offs)}}


def _own(n_prompts: int, tokens: int, r: int) -> list[list[int]]:
    """Round ``r``'s prompts (stored by its kvtier process)."""
    return prompts(n_prompts, tokens, seed=11 + 10 * r)


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(n_prompts: int, tokens: int, rounds: int, work: Path) -> dict[str, Any]:
    model = build_model(work / "model", **MODEL_SHAPE)
    base = {"model": str(model), "max_model_len": tokens + 64, "block_size": 128,
            "kv_cache_memory_bytes": 512 << 20}
    tiers = {"host_pool_bytes": "512MiB", "staging_pages": 64}
    load_before = os.getloadavg()
    first = prompts(n_prompts, tokens, seed=1)
    prefix = run_scenario(dict(base, connector=None, steps=_steps(
        prompts(1, tokens, seed=3)[0], _plain(first), _plain(first))), work)
    done = [_round(base, tiers, n_prompts, tokens, r, work) for r in range(rounds)]
    stored = done[0]["runs"]["kvtier"]
    fresh = run_scenario(dict(base, connector=dict(tiers, disk_url=f"file://{work / 'disk-0'}"),
                              prefix_caching=False,
                              steps=_steps(prompts(1, tokens, seed=4)[0],
                                           _plain(_own(n_prompts, tokens, 0)))), work)
    every = {key: [x for rnd in done for x in rnd[key]]
             for key in ("alone", "noop", "opted_out", "misses")}
    cases = {
        "recompute (vLLM alone)": every["alone"],
        "recompute (vLLM + no-op connector)": every["noop"],
        "recompute, request opted out of kvtier": every["opted_out"],
        "kvtier miss + store": every["misses"],
        "vLLM prefix-cache hit": prefix["steps"][2],
        "kvtier host hit": stored["steps"][2],
        "kvtier disk hit (fresh process)": fresh["steps"][1],
    }
    write_cpu, kvtier_cpu = [], []
    for rnd in done:
        kv = rnd["runs"]["kvtier"]
        mixed = kv["steps"][1]
        step_cpu = sum(x["cpu_seconds"] for x in mixed) + kv["actions"][1]["cpu_seconds"]
        off_cpu = statistics.median(x["cpu_seconds"] for x in rnd["opted_out"])
        write_cpu.append((step_cpu - off_cpu * len(mixed)) * 1e3 / len(rnd["misses"]))
        threads = (sum(x["kvtier_thread_cpu_seconds"] for x in mixed)
                   + kv["actions"][1]["kvtier_thread_cpu_seconds"])
        kvtier_cpu.append(threads * 1e3 / len(rnd["misses"]))
    counts = [rnd["runs"]["kvtier"]["connector"] for rnd in done]
    saves = [max(1, c.get("saved_tokens", 0) // (tokens // 128 * 128)) for c in counts]
    ratio_names = list(done[0]["ratios"])
    return {
        "prompts": n_prompts, "prompt_tokens": tokens, "rounds": rounds,
        "model_shape": MODEL_SHAPE,
        "cases": {name: {"ttft_ms_median": _median_ms(r),
                         "cached_tokens": [x["num_cached_tokens"] for x in r],
                         "computed_tokens": [x["computed_tokens"] for x in r],
                         "ttft_ms": [x["seconds"] * 1e3 for x in r]}
                  for name, r in cases.items()},
        "ratios_by_round": [rnd["ratios"] for rnd in done],
        "process_order_by_round": [rnd["order"] for rnd in done],
        "ratios": {name: _spread([rnd["ratios"][name] for rnd in done]) for name in ratio_names},
        "write_path_cpu_ms_per_request": _spread(write_cpu),
        "kvtier_threads_cpu_ms_per_request": _spread(kvtier_cpu),
        "saver_cpu_ms_per_request": {
            "copies": _spread([c.get("save_copy_cpu_us", 0) / 1e3 / n
                               for c, n in zip(counts, saves, strict=True)]),
            "commits": _spread([c.get("save_commit_cpu_us", 0) / 1e3 / n
                                for c, n in zip(counts, saves, strict=True)])},
        "saves_drained": [a["done"] for rnd in done for a in rnd["runs"]["kvtier"]["actions"]],
        "drain_seconds_after_miss_step": [rnd["runs"]["kvtier"]["actions"][1]["seconds"]
                                          for rnd in done],
        "load_average_before_after": [load_before, os.getloadavg()],
        "connector_counters": {"store_runs": counts, "fresh_run": fresh["connector"]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6, help="per case and round (even)")
    parser.add_argument("--tokens", type=int, default=1536)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "vllm_cpu.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-vllm-") as tmp:
        data = run(args.prompts, args.tokens, args.rounds, Path(tmp))
    rows = [[name, case["ttft_ms_median"], statistics.mean(case["cached_tokens"]),
             statistics.mean(case["computed_tokens"])] for name, case in data["cases"].items()]
    table = format_table(["case", "TTFT ms (median)", "cached tokens", "computed tokens"], rows)
    ratios = format_table(["TTFT ratio (median per round)", "median", "min", "max"],
                          [[name, f"{v['median']:.3f}", f"{v['min']:.3f}", f"{v['max']:.3f}"]
                           for name, v in data["ratios"].items()])
    saver, cpu = data["saver_cpu_ms_per_request"], data["write_path_cpu_ms_per_request"]
    threads = data["kvtier_threads_cpu_ms_per_request"]
    summary = (f"{table}\n\n{ratios}\n({data['rounds']} rounds of fresh processes, order "
               f"rotated: {data['process_order_by_round']})\n\n"
               f"write path, process CPU per stored request (all threads, vs opted out): median "
               f"{cpu['median']:.0f} ms (rounds {cpu['min']:.0f}-{cpu['max']:.0f})\n"
               f"kvtier's threads (saver, IO), CPU per stored request: median "
               f"{threads['median']:.0f} ms (rounds {threads['min']:.0f}-{threads['max']:.0f})\n"
               f"saver thread CPU per stored request: copies {saver['copies']['median']:.0f} ms, "
               f"commits {saver['commits']['median']:.0f} ms (medians over rounds)\n"
               f"saves still running after the miss step: "
               f"{max(data['drain_seconds_after_miss_step']):.2f} s until drained (longest)\n"
               f"load average before / after: {data['load_average_before_after']}\n")
    print(summary)
    out = write_report(args.out, "bench_vllm", data)
    out.with_suffix(".txt").write_text(summary)


if __name__ == "__main__":
    main()
