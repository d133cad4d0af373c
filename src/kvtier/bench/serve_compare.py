"""The serving benchmark behind ``kvtier bench serve``: one workload against each server.

Owns ``run`` (builds the workload, sends it to the server under test and, when asked, the same
requests to a ``--no-cache`` baseline right after, prints the table and writes JSON with machine
info, a text table beside it and a plot), and its parts, also used by ``benchmarks/serve/serve_load.py``:
``build_workload`` (``serve_workloads``), ``measure`` (``serve_load``), ``table``, ``settings``
and ``write`` (``serve_plot``). Every function takes the benchmark's settings as one object with
the attributes of ``kvtier bench serve``'s flags (``workload``, ``num_requests``,
``concurrency``, ``request_rate``, ``input_len``, ``output_len``, ``groups``, ``prefix_len``,
``trace``, ``block_tokens``, ``vocab``, ``seed``, ``api_key``; ``run`` also ``url``,
``baseline_url``, ``json``, ``plot``): the parsed arguments, or any namespace. Main thread (the
load generator adds one thread per request in flight).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

WORKLOADS = ("random", "shared-prefix", "multi-turn")
DEFAULT_TRACE = "../shared/traces/mooncake_conversation.jsonl"
COLUMNS = (("output_tokens_per_s", "out tok/s"), ("ttft_ms_p50", "TTFT p50"),
           ("ttft_ms_p99", "TTFT p99"), ("itl_ms_p50", "ITL p50"), ("itl_ms_p99", "ITL p99"),
           ("latency_ms_p50", "E2E p50"))


def build_workload(args: Any) -> list[Any]:
    """The requests of ``args.workload`` (random, shared-prefix, multi-turn), sized by ``args``."""
    from kvtier.bench import serve_workloads as w

    if args.workload == "random":
        return w.random_prompts(args.num_requests, args.input_len, args.output_len, args.vocab,
                                args.seed)
    if args.workload == "shared-prefix":
        return w.shared_prefix(args.num_requests, args.groups, args.prefix_len, args.input_len,
                               args.output_len, args.vocab, args.seed)
    return w.multi_turn(Path(args.trace), args.num_requests, args.block_tokens, args.output_len,
                        args.vocab)[:args.num_requests]


def measure(url: str, requests: list[Any], args: Any) -> dict[str, Any]:
    """Send ``requests`` to ``url`` at ``args``' concurrency or rate; the summary of the run."""
    from kvtier.bench.serve_load import model_name, run_load, summarize

    model = model_name(url, args.api_key)
    results, wall = run_load(url, model, requests, concurrency=args.concurrency,
                             rate=args.request_rate, seed=args.seed, api_key=args.api_key)
    return {"url": url, "model": model, **summarize(results, wall)}


def table(runs: dict[str, dict[str, Any]]) -> str:
    head = ["server", *[label for _, label in COLUMNS], "cached (device/host/disk/remote)"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for name, run in runs.items():
        cells = [name] + [_cell(run.get(key)) for key, _ in COLUMNS]
        share = run.get("cached_share") or {}
        cells.append(" / ".join(f"{100 * share.get(t, 0):.0f}%"
                                for t in ("device", "host", "disk", "remote")))
        lines.append(" | ".join(cells))
        if run.get("failed"):
            lines.append(f"  {run['failed']} failed: {run.get('errors')}")
    return "\n".join(lines) + "\n(times in ms)"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def settings(args: Any) -> dict[str, Any]:
    keys = ("workload", "num_requests", "concurrency", "request_rate", "input_len", "output_len",
            "groups", "prefix_len", "block_tokens", "vocab", "seed")
    return {k: getattr(args, k) for k in keys}


def write(result: dict[str, Any], text: str, json_path: str | None, plot: str | None) -> None:
    if json_path:
        from kvtier.machine import machine_info

        result = {"machine": machine_info(), **result}
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
        Path(json_path).with_suffix(".txt").write_text(text + "\n")
    if plot:
        from kvtier.bench.serve_plot import plot_runs

        plot_runs(result["runs"], plot, title=f"kvtier bench serve: {result['settings']}")


def run(args: Any) -> int:
    """The workload against ``args.url`` and, with ``args.baseline_url``, against the baseline
    right after; prints the table, writes JSON (``args.json``) and the plot (``args.plot``).
    Returns 0, or 1 when any request failed."""
    requests = build_workload(args)
    runs = {"kvtier": measure(args.url, requests, args)}
    if args.baseline_url:
        runs["no-cache"] = measure(args.baseline_url, requests, args)
    result = {"settings": settings(args), "runs": runs}
    text = table(runs)
    print(text)
    write(result, text, args.json, args.plot)
    return 0 if all(not r["failed"] for r in runs.values()) else 1
