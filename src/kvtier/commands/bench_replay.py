"""``kvtier bench replay``: replay a request trace through the real index, tiers and policies.

One run: ``--trace FILE`` (or ``--synthetic NAME``) with tier capacities in tokens and a policy
prints the share of input tokens each tier served, evictions, promotions and disk writes, beside
the offline bound at the same total capacity, and writes JSON with ``--json``. ``--study DIR``
runs the whole study instead (capacity curve for several policies and the bound, held-out
halves, synthetic workloads, write policies on a host + disk hierarchy, policy overhead, prefill
time saved) and writes ``replay_*`` JSON, table and plot into DIR. Main thread.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from kvtier.machine import format_table, write_report
from kvtier.replay.progress import progress_bar

DEFAULT_TRACE = "../shared/traces/mooncake_conversation.jsonl"


def _tokens(text: str) -> int:
    from kvtier.config import parse_size

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


def load_trace(args: argparse.Namespace) -> Any:
    from kvtier.replay import synthetic
    from kvtier.replay.trace import read_trace

    if args.synthetic:
        shape = synthetic.Shape(requests=args.limit or synthetic.Shape.requests,
                                block_tokens=args.block_tokens)
        return synthetic.make(args.synthetic, shape)
    return read_trace(args.trace or DEFAULT_TRACE, args.block_tokens, args.limit)


def run(args: argparse.Namespace) -> int:
    if args.study:
        from kvtier.replay.study import run_study

        run_study(load_trace(args), args.study, progress=not args.no_progress)
        return 0
    from kvtier.index.eviction import make_eviction_policy
    from kvtier.replay.bound import offline_bound
    from kvtier.replay.simulator import ReplayConfig, replay

    make_eviction_policy(args.policy)  # unknown names fail before the replay starts
    trace = load_trace(args)
    config = ReplayConfig(args.device_tokens, args.host_tokens, args.disk_tokens, args.policy,
                          args.write_policy, args.block_tokens, spread_ids=not args.raw_ids)
    with progress_bar(len(trace), config.label(), not args.no_progress) as bar:
        result = replay(trace, config, timed=args.timing, progress=bar.update)
    bound = None
    if not args.no_bound:
        capacity = sum(config.pages(t) for t in config.tiers())
        with progress_bar(len(trace), "offline bound", not args.no_progress) as bar:
            bound = offline_bound(trace, capacity, progress=bar.update)
    print(summary_table(trace, result, bound))
    if args.json:
        data = {"trace": trace.summary(), "result": result.to_dict(),
                "offline_bound": None if bound is None else asdict(bound) | {"share": bound.share}}
        write_report(args.json, "replay", data)
    return 0


def summary_table(trace: Any, result: Any, bound: Any) -> str:
    rows: list[list[Any]] = []
    for tier in result.config.tiers():
        rows.append([tier, result.config.pages(tier), f"{100 * result.share(tier):.2f}",
                     result.evicted_pages[tier], result.written_pages[tier]])
    rows.append(["all", "", f"{100 * result.served_share:.2f}", "", ""])
    if bound is not None:
        rows.append(["offline bound", bound.capacity_blocks, f"{100 * bound.share:.2f}", "", ""])
    head = (f"{trace.name}: {len(trace)} requests, {trace.input_tokens} input tokens, policy "
            f"{result.config.policy}, {result.config.write_policy}, {result.elapsed_s:.1f} s\n")
    promoted = ", ".join(f"{k} {v}" for k, v in sorted(result.promoted_pages.items())) or "none"
    table = format_table(["tier", "pages", "served %", "evicted pages", "written pages"], rows)
    return head + table + f"\npromoted pages: {promoted}"
