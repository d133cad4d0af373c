"""``engine_vs_vllm.py``'s report: the goals (kvtier / vLLM), the table over every case file
(TTFT, throughput, inter-token latency, kvtier's deterministic mode against its default, the
kernel's rows and bit-identity), warnings for hits that reused too few tokens, the errors each
case recorded, and reading the case files back. The parent process's main thread runs it once
the cases have ended.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from engine_vs_vllm_measure import ITL_BATCHES, NEW_TOKENS

#: Goals (kvtier / vLLM), from the engine's targets: TTFT and latency at most, throughput at
#: least.
GOALS = {"recompute": ("<=", 1.1), "device_hit": ("<=", 1.0), "host_hit": ("<=", 0.8),
         "throughput": (">=", 0.9), "itl_1": ("<=", 1.1), "itl_16": ("<=", None),
         "reference": ("<=", None)}


def ratio(a: Any, b: Any) -> float | None:
    ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and b
    return round(a / b, 3) if ok else None


def table(args: argparse.Namespace, cases: dict[str, dict[str, Any]]) -> tuple[str, list[Any]]:
    from kvtier.machine import format_table

    kv, main, native = (cases.get(c, {}) for c in ("kvtier", "vllm_main", "vllm_native"))
    rows: list[dict[str, Any]] = []

    def add(metric: str, goal_key: str, unit: str, ours: Any, theirs: Any) -> None:
        sense, target = GOALS[goal_key]
        r = ratio(ours, theirs)
        met = None
        if r is not None and target is not None:
            met = r <= target if sense == "<=" else r >= target
        rows.append({"metric": metric, "unit": unit, "kvtier": ours, "vllm": theirs,
                     "kvtier_over_vllm": r,
                     "goal": f"{sense} {target}" if target is not None else "-",
                     "met": met})

    for length in args.lengths:
        k = kv.get("ttft", {}).get(str(length), {})
        m = main.get("ttft", {}).get(str(length), {})
        n = native.get("ttft", {}).get(str(length), {})
        add(f"TTFT recompute {length}", "recompute", "ms", k.get("recompute_ms"),
            m.get("recompute_ms"))
        add(f"TTFT device hit {length}", "device_hit", "ms", k.get("device_hit_ms"),
            m.get("device_hit_ms"))
        add(f"TTFT host hit {length} (vLLM: native offload)", "host_hit", "ms",
            k.get("host_hit_ms"), n.get("host_hit_ms"))
    for level in args.levels:
        add(f"throughput {level} x {args.throughput_prompt} tok, {NEW_TOKENS} new", "throughput",
            "gen tok/s", kv.get("throughput", {}).get(str(level), {}).get("gen_tok_s"),
            main.get("throughput", {}).get(str(level), {}).get("gen_tok_s"))
    for batch in ITL_BATCHES:
        add(f"decode inter-token latency, batch {batch}", f"itl_{batch}", "ms",
            kv.get("itl", {}).get(str(batch), {}).get("itl_ms"),
            main.get("itl", {}).get(str(batch), {}).get("itl_ms"))
    for key, what in (("itl_ahead", "steps queued ahead"),
                      ("itl_one_at_a_time_again", "one at a time again")):
        for batch in ITL_BATCHES:       # kvtier's engine.decode_ahead, measured both ways
            ms = kv.get(key, {}).get(str(batch), {}).get("itl_ms")
            if ms is not None:
                add(f"decode ITL, batch {batch}, kvtier {what}", "reference", "ms", ms,
                    main.get("itl", {}).get(str(batch), {}).get("itl_ms"))
    add("KV capacity of the throughput runs", "reference", "tokens", kv.get("kv_tokens"),
        main.get("kv_tokens"))
    add("prefill tokens per step of the throughput runs", "reference", "tokens",
        kv.get("step_tokens"), main.get("step_tokens"))
    memory = kv.get("gpu_memory") or {}
    for key, what in (("kv_pool_gib", "KV page pool"),
                      ("other_at_peak_gib", "beyond weights and KV pool, at the peak")):
        if key in memory:
            add(f"kvtier GPU memory, {what} (throughput runs)", "reference", "GiB",
                memory[key], None)
    preempted = kv.get("engine_stats", {}).get("preempted")
    if preempted is not None:
        add("kvtier sequences preempted (whole run)", "reference", "count", preempted, None)
    verdict = {True: "met", False: "MISSED", None: "-"}
    engines = [c for c in ("kvtier", "vllm_main", "vllm_native") if c in cases]
    headers = ["metric", "unit", "kvtier", "vLLM", "kvtier/vLLM", "goal", "verdict"]
    text = "" if not engines else format_table(
        headers, [[r["metric"], r["unit"], _cell(r["kvtier"]), _cell(r["vllm"]),
                          _cell(r["kvtier_over_vllm"]), r["goal"], verdict[r["met"]]]
                         for r in rows])
    det = cases.get("kvtier_det", {})
    if det:
        text += "\n\n" if text else ""
        text += "kvtier's engine.deterministic (batch-invariant kernels) against its default:\n"
        text += format_table(["metric", "unit", "default", "deterministic", "det/default"],
                             [[m, u, _cell(a), _cell(b), _cell(ratio(b, a))]
                              for m, u, a, b in deterministic_rows(args, kv, det)])
    kernel = cases.get("kernel", {})
    if kernel.get("rows"):
        text += "\n\n" if text else ""
        text += "paged prefill kernel vs sdpa (one layer, causal, bf16, " \
                f"{kernel.get('shape')}; autotune: {kernel.get('autotune_best')}):\n"
        text += format_table(
            ["tokens", "page", "paged ms", "paged TFLOP/s", "sdpa ms", "sdpa TFLOP/s",
             "paged/sdpa time", "8192-steps ms", "steps TFLOP/s", "max |diff|"],
            [[r["tokens"], r["page_size"], r["paged_ms"], r["paged_tflops"], r["sdpa_ms"],
              r["sdpa_tflops"], r["paged_over_sdpa_time"], _cell(r.get("in_8192_steps_ms")),
              _cell(r.get("in_8192_steps_tflops")), f"{r['max_abs_diff_vs_sdpa']:.3g}"]
             for r in kernel["rows"]])
        text += f"\nbit-identical whole / stepped / suffix: {kernel.get('bitwise_all')} " \
                f"{kernel.get('bitwise')}"
    for warning in hit_warnings(args, cases):
        text += f"\nWARNING: {warning}"
    return text, rows


def deterministic_rows(args: argparse.Namespace, kv: dict[str, Any],
                       det: dict[str, Any]) -> list[tuple[str, str, Any, Any]]:
    """(metric, unit, default, deterministic) for what both kvtier cases measured."""
    rows = []
    for length in args.lengths:
        for key, name in (("recompute_ms", "recompute"), ("device_hit_ms", "device hit"),
                          ("host_hit_ms", "host hit")):
            rows.append((f"TTFT {name} {length}", "ms",
                         kv.get("ttft", {}).get(str(length), {}).get(key),
                         det.get("ttft", {}).get(str(length), {}).get(key)))
    for level in args.levels:
        rows.append((f"throughput {level} x {args.throughput_prompt} tok", "gen tok/s",
                     kv.get("throughput", {}).get(str(level), {}).get("gen_tok_s"),
                     det.get("throughput", {}).get(str(level), {}).get("gen_tok_s")))
    for batch in ITL_BATCHES:
        rows.append((f"decode inter-token latency, batch {batch}", "ms",
                     kv.get("itl", {}).get(str(batch), {}).get("itl_ms"),
                     det.get("itl", {}).get(str(batch), {}).get("itl_ms")))
    return rows


def hit_warnings(args: argparse.Namespace, cases: dict[str, dict[str, Any]]) -> list[str]:
    """Hits that did not come from the cache they were meant to (their TTFT is no hit's)."""
    out = []
    for case, field in (("kvtier", "device_hit"), ("kvtier", "host_hit"),
                        ("vllm_main", "device_hit"), ("vllm_native", "host_hit")):
        for length in args.lengths:
            cached = cases.get(case, {}).get("ttft", {}).get(str(length), {}).get(f"{field}_cached")
            if cached and min(c or 0 for c in cached) < length - 64:
                out.append(f"{case} {field} at {length} tokens reused only {cached} tokens")
    return out


def _cell(value: Any) -> Any:
    return "-" if value is None else value


def load_cases(out: Path) -> dict[str, dict[str, Any]]:
    cases = {}
    for path in sorted((out / "cases").glob("*.json")):
        try:
            data = json.loads(path.read_text())
            cases[data["case"]] = data
        except (OSError, ValueError, KeyError):
            continue
    return cases


def sub_errors(data: Any, where: str = "") -> list[tuple[str, str]]:
    """Every ``*_error`` a case recorded (a measurement that failed while the case went on)."""
    out: list[tuple[str, str]] = []
    if isinstance(data, dict):
        for key, value in data.items():
            if key.endswith("_error"):
                out.append((f"{where}{key[:-6]}", str(value)))
            else:
                out += sub_errors(value, f"{where}{key}.")
    return out


def gpu_names() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return ", ".join(torch.cuda.get_device_name(i)
                             for i in range(torch.cuda.device_count()))
    except Exception:   # a report, whatever the machine
        pass
    return "no CUDA device"
