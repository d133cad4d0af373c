"""``kvtier bench ttft``: time to first token per cache tier and prefix length, against recompute.

Loads the model once, runs ``kvtier.bench.ttft`` (every hit paired with a recompute of the same
prompt length with kvtier off), prints a table, checks the goals, and writes JSON (with machine
info), a text table beside it and a PNG plot (``kvtier.bench.ttft_report``). Also reports the
miss-path overhead: TTFT with kvtier on and 0% hits against ``--no-cache``. Needs no web
framework or Redis client unless a ``redis`` tier is asked for. The command's arguments only.
Main thread.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvtier.config_flags import add_config_flags, config_from_args

DEFAULT_TIERS = "recompute,device,host,disk,disk-load"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("ttft", help="Time to first token per tier and prefix length.")
    parser.add_argument("--prefix-tokens", default="1024,4096,16384,32768",
                        help="Comma-separated cached prefix lengths.")
    parser.add_argument("--tiers", default=DEFAULT_TIERS,
                        help="Comma-separated: recompute, device, host, disk, disk-load "
                             "(disk without the hybrid split), redis, redis-load.")
    parser.add_argument("--repeats", type=int, default=3, help="Prefixes per length (median).")
    parser.add_argument("--suffix-tokens", type=int, default=32,
                        help="New tokens after the cached prefix in each request.")
    parser.add_argument("--json", metavar="OUT", help="Write results as JSON (and OUT.txt).")
    parser.add_argument("--plot", metavar="PNG", help="Write the plot here.")
    parser.add_argument("--cold-disk", choices=("fadvise", "drop_caches"), default="fadvise",
                        help="How disk hits are made cold: evict the store's files from the page "
                             "cache (fadvise), or drop the whole machine's page cache (root; only "
                             "on a machine of the benchmark's own) [default: fadvise].")
    parser.add_argument("--no-progress", action="store_true", help="No progress bar.")
    add_config_flags(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kvtier.bench.ttft import run_ttft
    from kvtier.bench.ttft_report import report

    summary = run_ttft(config_from_args(args),
                       tiers=tuple(t.strip() for t in args.tiers.split(",") if t.strip()),
                       prefix_tokens=tuple(int(n) for n in args.prefix_tokens.split(",")),
                       repeats=args.repeats, suffix_tokens=args.suffix_tokens,
                       cold_disk=args.cold_disk, progress=not args.no_progress)
    return report(summary, args.json, args.plot)
