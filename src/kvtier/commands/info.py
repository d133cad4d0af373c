"""``kvtier info``: print the resolved configuration, a model's KV layout and its key namespace.

Useful to check what a config file, ``KVTIER_*`` variables and flags add up to before starting a
server. Runs on the main thread; imports nothing heavy.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvtier.config import to_dict
from kvtier.config_flags import add_config_flags, config_from_args


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "info", help="Print the resolved config (defaults < file < env < flags).",
        description="Print the resolved configuration; secrets are redacted.",
    )
    parser.add_argument("--json", action="store_true", help="Print JSON instead of text.")
    add_config_flags(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    data = to_dict(config)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    for section, values in data.items():
        print(f"[{section}]")
        for name, value in values.items():
            print(f"  {name:34s} {value}")
    return 0
