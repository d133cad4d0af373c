"""The default policy against LRU with the replay's page identities raw and spread like live keys.

``shadow`` samples pages by the leading bytes of their identity. In the live cache that is a
page key, a content hash, so the sample is spread uniformly; in a replay it is the trace's block
id, numbered in order of first appearance, so the raw ids' leading bytes sample the pages first
seen in windows of time. ``ReplayConfig.spread_ids`` maps the ids through a bijective hash
(``TraceRequest.block_bytes(spread=True)``), which changes only which pages the miniatures see:
LRU serves exactly the same either way. For every case of the study's ``default_margin`` (the
trace's capacity curve, both held-out halves, the synthetic shapes at shares of their unique
blocks, each shape generated with every seed of ``--seeds``) this replays LRU once and
``shadow`` with raw and with spread ids, side by side, and reports each margin over LRU, the
worst of each and how many points fall below the goal's -0.2. Spread ids are the replay's
default. Prints a table and writes ``--json`` (with machine info). Main thread. Usage::

    PYTHONPATH=src python benchmarks/index/replay_sampling.py \\
        --trace ../shared/traces/mooncake_conversation.jsonl \\
        --seeds 0,1,2,3,4,5 --json benchmarks/results/replay_sampling.json
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from kvtier.machine import format_table, write_report
from kvtier.replay import synthetic
from kvtier.replay.simulator import ReplayConfig, replay
from kvtier.replay.study import CURVE_TOKENS, DEFAULT_POLICY, MARGIN_FRACTIONS
from kvtier.replay.trace import Trace, read_trace


def cases(trace: Trace, seeds: list[int]) -> list[tuple[Trace, list[int]]]:
    """The whole trace and its halves at the curve's capacities, the synthetic shapes (one per
    seed, named ``shape/sN``) at ``MARGIN_FRACTIONS`` of their unique blocks (the study's
    margin cases, plus the trace)."""
    out = [(part, list(CURVE_TOKENS)) for part in (trace, trace.part(0, 2), trace.part(1, 2))]
    for seed in seeds:
        for name in synthetic.GENERATORS:
            made = synthetic.make(name, synthetic.Shape(seed=seed))
            made = dataclasses.replace(made, name=f"{made.name}/s{seed}")
            out.append((made, [max(int(made.unique_blocks() * f), 2) * made.block_tokens
                               for f in MARGIN_FRACTIONS]))
    return out


def served(part: Trace, tokens: int, policy: str, spread: bool) -> float:
    config = ReplayConfig(tokens, policy=policy, block_tokens=part.block_tokens,
                          spread_ids=spread)
    return replay(part, config).served_share


def run(trace: Trace, seeds: list[int]) -> list[dict[str, Any]]:
    rows = []
    for part, capacities in cases(trace, seeds):
        for tokens in capacities:
            lru = served(part, tokens, "lru", False)
            raw = served(part, tokens, DEFAULT_POLICY, False)
            spread = served(part, tokens, DEFAULT_POLICY, True)
            rows.append({"trace": part.name, "tokens": tokens, "lru": lru, "raw_ids": raw,
                         "spread_ids": spread, "margin_raw": raw - lru,
                         "margin_spread": spread - lru})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--seeds", default="0", help="synthetic seeds, comma-separated")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds: integers separated by commas, got {args.seeds!r}")
    rows = run(read_trace(args.trace), seeds)
    table = format_table(
        ["trace", "tokens", "LRU %", "shadow raw ids %", "shadow spread ids %", "margin raw",
         "margin spread"],
        [[r["trace"], f"{r['tokens'] / 1e6:.3f}M", f"{100 * r['lru']:.2f}",
          f"{100 * r['raw_ids']:.2f}", f"{100 * r['spread_ids']:.2f}",
          f"{100 * r['margin_raw']:+.2f}", f"{100 * r['margin_spread']:+.2f}"] for r in rows])
    worst = {key: min(rows, key=lambda r: r[key]) for key in ("margin_raw", "margin_spread")}
    summary = {key: {"points": round(100 * r[key], 3), "trace": r["trace"], "tokens": r["tokens"]}
               for key, r in worst.items()}
    for key, s in summary.items():
        s["below_goal"] = sum(1 for r in rows if r[key] < -0.002)
    text = table + "\nworst margin over LRU (points): " + ", ".join(
        f"{key.removeprefix('margin_')} ids {s['points']:+.2f} ({s['trace']}, "
        f"{s['tokens'] / 1e6:g}M; {s['below_goal']} of {len(rows)} points below -0.2)"
        for key, s in summary.items())
    print(text)
    if args.json:
        write_report(args.json, "replay_sampling", {"trace": args.trace, "seeds": seeds,
                                                    "rows": rows,
                                                    "worst": summary})
        args.json.with_suffix(".txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
