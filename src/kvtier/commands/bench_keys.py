"""``kvtier bench keys``: time page-key hashing for long prompts at several page sizes.

The command's arguments only; the benchmark is ``kvtier.bench.key_hashing``. Main thread.
"""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("keys", help="Time page-key hashing.")
    parser.add_argument("--tokens", type=int, default=131072, help="Prompt length in tokens.")
    parser.add_argument("--page-sizes", default="16,32,64,128,256",
                        help="Comma-separated page sizes.")
    parser.add_argument("--repeats", type=int, default=20, help="Timed repeats (median taken).")
    parser.add_argument("--json", metavar="OUT", help="Write results as JSON here.")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kvtier.bench.key_hashing import run as run_key_hashing

    page_sizes = [int(p) for p in args.page_sizes.split(",")]
    return run_key_hashing(args.tokens, page_sizes, args.repeats, args.json)
