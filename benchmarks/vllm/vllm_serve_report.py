"""``vllm_serve.py``'s report: per workload and config the TTFT, ITL, rates, cached share and
where it came from (vLLM's GPU prefix cache or the connector's / offloading's load), preemptions
and failures, the kvtier/native and kvtier/alone ratios as a table, and the GPU's
tag the result files are named after. The main thread runs it once every server has stopped.
"""

from __future__ import annotations

import subprocess
from typing import Any

from vllm_serve_server import CONFIGS, KVTIER_CONFIGS, PHASES

#: kvtier's counters of saves that did not store their prompt (``vllm:kvtier_*`` on /metrics).
LOST_SAVES = ("saves_dropped_queue_full", "saves_refused_no_staging", "saves_refused_evicted",
              "saves_refused_host_moved", "saves_refused_no_host_room", "saves_incomplete", "saves_failed")
METRICS = (("ttft_ms_p50", "TTFT p50"), ("ttft_ms_p99", "TTFT p99"), ("itl_ms_p50", "ITL p50"),
           ("requests_per_s", "req/s"), ("output_tokens_per_s", "out tok/s"),
           ("cached_tokens_share", "cached"))


def _ratio(a: Any, b: Any) -> float | None:
    ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and b
    return round(a / b, 3) if ok else None


def summarize_runs(results: list[dict[str, Any]],
                   workloads: list[str]) -> tuple[dict[str, Any], str]:
    from kvtier.machine import format_table

    by = {r["config"]: r.get("workloads", {}) for r in results}
    summary: dict[str, Any] = {}
    rows = []
    for name in workloads:
        cells = {c: by.get(c, {}).get(name, {}) for c in CONFIGS}
        ratios = {f"{ours}/{base}": {key: _ratio(cells[ours].get(key), cells[base].get(key))
                                     for key, _ in METRICS[:-1]}
                  for ours in KVTIER_CONFIGS if cells[ours] for base in ("native", "alone")}
        summary[name] = {"ratios": ratios}
        for c in CONFIGS:
            w = cells[c]
            hits = w.get("vllm_counters", {})
            lost = (int(sum(hits.get(f"vllm:kvtier_{k}", 0) for k in LOST_SAVES))
                    if hits and c in KVTIER_CONFIGS else "")
            rows.append([name, c, *[w.get(key) for key, _ in METRICS],
                         *_sources(hits, w.get("prompt_tokens")),
                         int(hits.get("vllm:num_preemptions", 0)) if hits else None, lost,
                         w.get("failed", w.get("error", "not run"))])
        for base, r in ratios.items():
            rows.append([name, base, *[r.get(key) for key, _ in METRICS[:-1]],
                         "", "", "", "", "", ""])
    text = format_table(["workload", "config", *[label for _, label in METRICS], "from GPU",
                         "loaded", "preempt", "saves lost", "failed"], rows)
    text += "\n(times in ms; cached: share of prompt tokens the server reports cached; from " \
            "GPU / loaded: shares of prompt tokens vLLM's own prefix cache hit and the " \
            "connector or native offloading loaded (vllm:prefix_cache_hits, " \
            "vllm:external_prefix_cache_hits); " \
            "saves lost: kvtier's saves dropped, refused, incomplete or failed; " \
            "kvtier/X and direct/X rows (direct: kvtier's direct path): ratios, lower is " \
            "better for times, higher for rates)"
    cpu = [line for c in KVTIER_CONFIGS for line in connector_cpu(c, by.get(c, {}), workloads)]
    for line in cpu + phases(by, workloads):
        text += "\n" + line
    return summary, text


def connector_cpu(config: str, kvtier: dict[str, Any], workloads: list[str]) -> list[str]:
    """Per workload, kvtier's connector CPU inside vLLM's engine loop per request (ms), from its
    ``vllm:kvtier_*_us`` counters: the step hooks (of them the saves' plan, copy and commit) and
    the scheduler's lookups and step metadata; and how many saves went to host only."""
    lines = []
    for name in workloads:
        w = kvtier.get(name, {})
        counters, requests = w.get("vllm_counters", {}), w.get("requests")
        if not requests or "vllm:kvtier_worker_hooks_us" not in counters:
            continue
        ms = {k: f"{counters.get(f'vllm:kvtier_{k}', 0) / requests / 1e3:.2f}"
              for k in ("worker_hooks_us", "save_plan_cpu_us", "save_copy_cpu_us",
                        "save_commit_cpu_us", "lookup_us", "meta_build_us")}
        lines.append(f"kvtier's connector CPU in vLLM's loop ({config}), {name}, ms per request: "
                     f"step hooks "
                     f"{ms['worker_hooks_us']} (saves: plan {ms['save_plan_cpu_us']}, copy "
                     f"{ms['save_copy_cpu_us']}, commit {ms['save_commit_cpu_us']}), lookups "
                     f"{ms['lookup_us']}, step metadata {ms['meta_build_us']}; saves to host "
                     f"only {int(counters.get('vllm:kvtier_saves_to_host_only', 0))}")
    return lines


def phases(by: dict[str, dict[str, Any]], workloads: list[str]) -> list[str]:
    """Per workload and config, vLLM's own split of a TTFT, means in ms per request: waiting to
    be scheduled (a request waiting for its load outside the step, as native offloading's do,
    counts here), scheduled to first token, and the server's TTFT."""
    lines = []
    for name in workloads:
        for config in CONFIGS:
            counters = by.get(config, {}).get(name, {}).get("vllm_counters", {})
            means = []
            for phase in PHASES:
                n = counters.get(f"{phase}_count", 0.0)
                means.append(f"{counters.get(f'{phase}_sum', 0.0) / n * 1e3:.1f}" if n else "-")
            if any(m != "-" for m in means):
                lines.append(f"vLLM's phases, {name}, {config}, mean ms per request: queued "
                             f"{means[0]}, scheduled to first token {means[1]}, TTFT {means[2]}")
    return lines


def _sources(counters: dict[str, float], prompt_tokens: Any) -> list[float | None]:
    """Shares of ``prompt_tokens`` from vLLM's GPU prefix cache and from a load."""
    if not counters or not prompt_tokens:
        return [None, None]
    return [round(counters.get(f"vllm:{name}", 0.0) / prompt_tokens, 3)
            for name in ("prefix_cache_hits", "external_prefix_cache_hits")]


def gpu_tag() -> str:
    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "cpu"
    for tag in ("h200", "h100", "a100", "l40s", "b200"):
        if tag in name.lower():
            return tag
    return name.split("\n")[0].strip().lower().replace(" ", "_") or "cpu"
