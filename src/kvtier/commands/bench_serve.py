"""``kvtier bench serve``: a serving benchmark against running servers (like ``vllm bench serve``).

Builds a workload (``serve_workloads``: random prompts, shared-prefix groups, multi-turn replayed
from the Mooncake trace), sends it at a concurrency or a request rate (``serve_load``) to
``--url`` and, with ``--baseline-url`` (a server started with ``--no-cache``), the same requests
to the baseline right after, and reports TTFT p50/p99, inter-token latency p50/p99, throughput
and the cached share of prompt tokens per tier for each, as a table, JSON (with machine info)
and a plot. Main thread (the load generator adds one thread per request in flight).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

WORKLOADS = ("random", "shared-prefix", "multi-turn")
DEFAULT_TRACE = "../shared/traces/mooncake_conversation.jsonl"
COLUMNS = (("output_tokens_per_s", "out tok/s"), ("ttft_ms_p50", "TTFT p50"),
           ("ttft_ms_p99", "TTFT p99"), ("itl_ms_p50", "ITL p50"), ("itl_ms_p99", "ITL p99"),
           ("latency_ms_p50", "E2E p50"))


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("serve", help="Load a running server: TTFT, ITL, throughput.")
    parser.add_argument("--url", required=True, help="Base URL of the server under test.")
    parser.add_argument("--baseline-url", help="A server started with --no-cache: the same "
                        "workload runs against it too, side by side.")
    parser.add_argument("--api-key", default="", help="Bearer key (server.api_key).")
    parser.add_argument("--workload", choices=WORKLOADS, default="random")
    parser.add_argument("--num-requests", type=int, default=64)
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="Requests in flight at most.")
    load.add_argument("--request-rate", type=float, help="Poisson arrivals per second.")
    parser.add_argument("--input-len", type=int, default=256,
                        help="Prompt tokens (random), or each request's own suffix (shared-prefix).")
    parser.add_argument("--output-len", type=int, default=128,
                        help="Tokens to generate (multi-turn: the most per request).")
    parser.add_argument("--groups", type=int, default=4, help="shared-prefix: prefix groups.")
    parser.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: its length.")
    parser.add_argument("--trace", default=DEFAULT_TRACE, help="multi-turn: the trace file.")
    parser.add_argument("--block-tokens", type=int, default=512, help="multi-turn: tokens per "
                        "trace block (512 replays the trace's real lengths; less scales it down).")
    parser.add_argument("--vocab", type=int, default=1000, help="Token ids are drawn below this.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="OUT", help="Write results as JSON (and OUT.txt).")
    parser.add_argument("--plot", metavar="PNG", help="Write the plot here.")
    parser.set_defaults(handler=run)


def build_workload(args: argparse.Namespace) -> list[Any]:
    from kvtier.commands import serve_workloads as w

    if args.workload == "random":
        return w.random_prompts(args.num_requests, args.input_len, args.output_len, args.vocab,
                                args.seed)
    if args.workload == "shared-prefix":
        return w.shared_prefix(args.num_requests, args.groups, args.prefix_len, args.input_len,
                               args.output_len, args.vocab, args.seed)
    return w.multi_turn(Path(args.trace), args.num_requests, args.block_tokens, args.output_len,
                        args.vocab)[:args.num_requests]


def measure(url: str, requests: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    from kvtier.commands.serve_load import model_name, run_load, summarize

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


def settings(args: argparse.Namespace) -> dict[str, Any]:
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
        from kvtier.commands.serve_plot import plot_runs

        plot_runs(result["runs"], plot, title=f"kvtier bench serve: {result['settings']}")


def run(args: argparse.Namespace) -> int:
    requests = build_workload(args)
    runs = {"kvtier": measure(args.url, requests, args)}
    if args.baseline_url:
        runs["no-cache"] = measure(args.baseline_url, requests, args)
    result = {"settings": settings(args), "runs": runs}
    text = table(runs)
    print(text)
    write(result, text, args.json, args.plot)
    return 0 if all(not r["failed"] for r in runs.values()) else 1
