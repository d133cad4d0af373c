"""kvtier's settings as command-line flags: ``--section.field`` (and its alias) for every field
of the schema in ``kvtier.config``, read back into a ``KvtierConfig``.

Owns ``add_config_flags``, ``config_from_args`` and ``explicit_paths``. Main thread, at start.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from kvtier.config import KvtierConfig, build_config, iter_fields, read_env, read_yaml
from kvtier.units import format_size


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--section.field`` (and its alias, if any) for every field, help from the schema."""
    parser.add_argument("--config", metavar="FILE", help="YAML config file (sections as below).")
    for path, f in iter_fields():
        names = [f"--{path}"]
        if f.metadata.get("alias"):
            names.append(f.metadata["alias"])
        choices = f.metadata.get("choices")
        shown: object = "***" if f.metadata.get("secret") and f.default else f.default
        if f.metadata.get("size") and isinstance(f.default, int):
            shown = format_size(f.default)
        text = f"{f.metadata['help']} [default: {shown!s}]"
        text += f" {{{', '.join(choices)}}}" if choices else ""
        parser.add_argument(*names, dest=f"cfg:{path}", default=None, metavar="VALUE",
                            help=text.replace("%", "%%"))  # argparse %-formats help


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> KvtierConfig:
    flags = {k[4:]: v for k, v in vars(args).items() if k.startswith("cfg:") and v is not None}
    return build_config(getattr(args, "config", None), env, flags)


def explicit_paths(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> set[str]:
    """The 'section.field's that ``--config``, ``KVTIER_*`` variables or flags set."""
    file = getattr(args, "config", None)
    paths = set(read_yaml(file)) if file else set()
    paths |= set(read_env(os.environ if env is None else env))
    return paths | {k[4:] for k, v in vars(args).items() if k.startswith("cfg:") and v is not None}
