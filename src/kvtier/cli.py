"""The ``kvtier`` command line: one subcommand per module under ``kvtier.commands``.

Owns argument parsing and dispatch only. Each command module exposes ``register(subparsers)``
(which adds its parser and sets ``handler``) and keeps heavy imports inside its handler, so
``kvtier --help`` is instant. Runs on the main thread.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvtier import __version__
from kvtier.errors import KvtierError

#: Command modules, in the order ``kvtier --help`` lists them.
COMMAND_MODULES: tuple[str, ...] = (
    "kvtier.commands.info",
    "kvtier.commands.serve",
    "kvtier.commands.bench",
    "kvtier.commands.plan",
    "kvtier.commands.store",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="kvtier: a tiered KV cache for LLM inference (device, host, disk, Redis).",
    )
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except KvtierError as exc:
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
