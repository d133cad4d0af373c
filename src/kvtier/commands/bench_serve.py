"""``kvtier bench serve``: a serving benchmark against running servers (like ``vllm bench serve``).

Builds a workload (random prompts, shared-prefix groups, multi-turn replayed from the Mooncake
trace), sends it at a concurrency or a request rate to ``--url`` and, with ``--baseline-url`` (a
server started with ``--no-cache``), the same requests to the baseline right after, and reports
TTFT p50/p99, inter-token latency p50/p99, throughput and the cached share of prompt tokens per
tier for each, as a table, JSON (with machine info) and a plot. The command's arguments only;
the benchmark is ``kvtier.bench.serve_compare``. Main thread.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvtier.bench.serve_compare import DEFAULT_TRACE, WORKLOADS


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


def run(args: argparse.Namespace) -> int:
    from kvtier.bench.serve_compare import run as run_serve_bench

    return run_serve_bench(args)
