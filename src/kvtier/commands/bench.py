"""``kvtier bench ...``: benchmarks, one sub-subcommand per module listed in ``BENCH_MODULES``.

Each module exposes ``register(subparsers)`` like a top-level command. Main thread.
"""

from __future__ import annotations

import importlib
from typing import Any

BENCH_MODULES: tuple[str, ...] = (
    "kvtier.commands.bench_keys",
    "kvtier.commands.bench_ttft",
    "kvtier.commands.bench_store",
    "kvtier.commands.bench_replay",
    "kvtier.commands.bench_serve",
)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("bench", help="Benchmarks (keys, store, ...).",
                                   description="Benchmarks that print a table and write JSON.")
    inner = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name in BENCH_MODULES:
        importlib.import_module(name).register(inner)
