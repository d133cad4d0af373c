"""``kvtier bench store``: a page store's write, contains and read throughput beside a raw
baseline of the same bytes on the same device, measured in the same run.

    kvtier bench store --url file:///var/tmp/kvtier-bench --total 1GiB --page-bytes 64KiB,1MiB \
        --threads 4 --cache both --json benchmarks/results/disk_store.json

The command's arguments only; the benchmark (its runs, the raw baselines, the table and the
JSON) is ``kvtier.bench.store_throughput``. Main thread.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from kvtier.config import ControllerConfig
from kvtier.units import parse_size


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("store", help="Page store throughput beside a raw baseline.",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="Store URL (file:// runs in a fresh "
                        "subdirectory per run, removed afterwards).")
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--pages", type=_positive_int, help="Pages per run.")
    size.add_argument("--total", type=_positive_size,
                      help="Bytes per run (e.g. 1GiB); pages = total / page bytes.")
    parser.add_argument("--page-bytes", type=_listed(_positive_size), default=[64 << 10],
                        help="Page sizes, comma-separated (default: 64KiB).")
    parser.add_argument("--threads", type=_listed(_positive_int),
                        default=[ControllerConfig().io_workers],
                        help="IO thread counts, comma-separated (default: controller.io_workers).")
    parser.add_argument("--batch", type=_positive_int, default=32, help="Pages per store call.")
    parser.add_argument("--cold", action="store_true", help="Cold reads only (same as "
                        "--cache cold).")
    parser.add_argument("--cache", choices=("warm", "cold", "both"), default="warm",
                        help="Page cache state for the read phases.")
    parser.add_argument("--repeats", type=_positive_int, default=3,
                        help="Read passes (best taken).")
    parser.add_argument("--json", metavar="OUT", help="Write results as JSON here.")
    parser.set_defaults(handler=run)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_size(text: str) -> int:
    value = parse_size(text)
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"not a positive byte count such as 64KiB: {text!r}")
    return value


def _listed(one: Callable[[str], int]) -> Callable[[str], list[int]]:
    """An argparse type for a comma-separated list of ``one``'s values."""

    def parse(text: str) -> list[int]:
        return [one(part.strip()) for part in text.split(",")]

    return parse


def run(args: argparse.Namespace) -> int:
    from kvtier.bench.store_throughput import run as run_store_bench

    return run_store_bench(args.url, page_sizes=args.page_bytes, pages=args.pages,
                           total=args.total, thread_counts=args.threads, batch=args.batch,
                           cache="cold" if args.cold else args.cache, repeats=args.repeats,
                           json_path=args.json)
