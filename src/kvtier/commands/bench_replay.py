"""``kvtier bench replay``: replay a request trace through the real index, tiers and policies.

One run: ``--trace FILE`` (or ``--synthetic NAME``) with tier capacities in tokens and a policy
prints the share of input tokens each tier served, evictions, promotions and disk writes, beside
the offline bound at the same total capacity, and writes JSON with ``--json``. ``--study DIR``
runs the whole study instead (capacity curve for several policies and the bound, held-out
halves, synthetic workloads, write policies on a host + disk hierarchy, policy overhead, prefill
time saved) and writes ``replay_*`` JSON, table and plot into DIR.

The command's arguments only; the replay is ``kvtier.bench.trace_replay``. Main thread.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvtier.bench.trace_replay import DEFAULT_TRACE


def _tokens(text: str) -> int:
    from kvtier.units import parse_size

    value = parse_size(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 3000000 or 3M)")
    return value


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "replay", help="Replay a request trace through the index (served share per tier).",
        description=__doc__.split("\n\n")[1] if __doc__ else None)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", metavar="FILE", default=None,
                        help=f"JSON-lines trace (Mooncake format) [default: {DEFAULT_TRACE}]")
    source.add_argument("--synthetic", metavar="NAME",
                        choices=("chat", "agent", "rag", "scan", "multiturn", "short", "system"),
                        help="Replay a generated workload instead: chat, agent, rag, scan, "
                             "multiturn, short or system.")
    parser.add_argument("--block-tokens", type=int, default=512, help="Tokens per trace block.")
    parser.add_argument("--device-tokens", type=_tokens, default=3_000_000,
                        help="Device tier capacity in tokens (e.g. 3M).")
    parser.add_argument("--host-tokens", type=_tokens, default=0, help="Host tier (0: off).")
    parser.add_argument("--disk-tokens", type=_tokens, default=0, help="Disk tier (0: off).")
    parser.add_argument("--policy", default="lru", help="Eviction policy of every tier.")
    parser.add_argument("--write-policy", default="write_through",
                        choices=("write_through", "write_through_selective"),
                        help="Which device pages get a host (and disk) copy.")
    parser.add_argument("--raw-ids", action="store_true",
                        help="Page identities as the trace's raw block ids (numbered in order "
                             "of first appearance) instead of spread like live page keys (a "
                             "bijective hash of the ids, the default): the default policy's "
                             "sample then sees windows of time, not what it sees live.")
    parser.add_argument("--limit", type=int, default=None, help="Replay the first N requests.")
    parser.add_argument("--no-bound", action="store_true", help="Skip the offline bound.")
    parser.add_argument("--timing", action="store_true", help="Time every policy call.")
    parser.add_argument("--no-progress", action="store_true", help="No progress bar.")
    parser.add_argument("--json", metavar="OUT", help="Write results as JSON here.")
    parser.add_argument("--study", metavar="DIR",
                        help="Run the whole study and write replay_* results into DIR.")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kvtier.bench import trace_replay

    if args.study:
        return trace_replay.run_study(args.trace, args.synthetic, args.block_tokens, args.limit,
                                      args.study, progress=not args.no_progress)
    return trace_replay.run(
        args.trace, args.synthetic, args.limit, device_tokens=args.device_tokens,
        host_tokens=args.host_tokens, disk_tokens=args.disk_tokens, policy=args.policy,
        write_policy=args.write_policy, block_tokens=args.block_tokens,
        spread_ids=not args.raw_ids, bound=not args.no_bound, timed=args.timing,
        progress=not args.no_progress, json_path=args.json)
