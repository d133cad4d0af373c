"""Eviction policy cost per operation, every policy side by side in one run.

Each policy runs inside a real single-tier replay of the request trace (the index calls it as it
would in a live cache, so nodes carry their real state at every call), wrapped in
``TimedPolicy``: wall time per method (``add``, ``remove``, ``touch``, ``pop_victim``,
``forget``) less the wrapper's own cost, measured once with an empty policy. The replays of one
round run back to back in a rotating order, and each policy keeps its best round (a shared
machine's noise only ever adds time). Reports microseconds per call, per request, and the
ratio to LRU measured in the same round (steadier than absolute times on a busy machine): the
best round's and the median over all rounds. The JSON also records the machine's load average
before and after the run (absolute times on a shared machine scale with it). For policies that
run miniature caches (``shadow``'s ``Duel``), the time spent in the miniatures (``Duel.flush``,
timed inside the calls that fill a batch, so it is part of their ``add`` and ``touch``) is
reported apart: per policy call and per sampled reference.

Run: ``python benchmarks/index/bench_policy_cost.py [--trace FILE] [--tokens 3M] [--rounds 3]
[--json out.json]``. Main thread.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

from kvtier.index import minisim
from kvtier.index.eviction import EVICTION_POLICIES
from kvtier.machine import format_table, write_report
from kvtier.replay.simulator import ReplayConfig, replay
from kvtier.replay.trace import read_trace
from kvtier.units import parse_size

METHODS = ("add", "remove", "touch", "pop_victim", "forget")


@contextlib.contextmanager
def timed_miniatures() -> Iterator[dict[str, int]]:
    """While active, every ``Duel.flush`` adds its wall time and the references it ran."""
    spent = {"ns": 0, "refs": 0}
    original = minisim.Duel.flush

    def flush(duel: minisim.Duel) -> None:
        refs = duel.refs
        start = time.perf_counter_ns()
        original(duel)
        spent["ns"] += time.perf_counter_ns() - start
        spent["refs"] += duel.refs - refs

    minisim.Duel.flush = flush  # type: ignore[method-assign]
    try:
        yield spent
    finally:
        minisim.Duel.flush = original  # type: ignore[method-assign]


def one_round(trace: Any, tokens: int, policies: list[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for policy in policies:
        with timed_miniatures() as spent:
            result = replay(trace, ReplayConfig(tokens, policy=policy,
                                                block_tokens=trace.block_tokens), timed=True)
        timing = (result.policy_timing or {})["device"]
        calls = timing["all"]["calls"]
        out[policy] = {"timing": timing, "requests": result.requests,
                       "served_share": result.served_share,
                       "miniatures": {"sampled_refs": spent["refs"],
                                      "us_per_call": spent["ns"] / 1e3 / max(calls, 1),
                                      "us_per_ref": spent["ns"] / 1e3 / max(spent["refs"], 1)}}
    return out


def measure(trace: Any, tokens: int, policies: list[str], rounds: int) -> dict[str, Any]:
    best: dict[str, dict[str, Any]] = {}
    ratios: dict[str, list[float]] = {p: [] for p in policies}
    for r in range(rounds):
        order = policies[r % len(policies):] + policies[:r % len(policies)]
        got = one_round(trace, tokens, order)
        lru = got["lru"]["timing"]["all"]["us_per_call"]
        for policy, row in got.items():
            us = row["timing"]["all"]["us_per_call"]
            row["ratio_to_lru"] = us / lru
            ratios[policy].append(us / lru)
            if policy not in best or us < best[policy]["timing"]["all"]["us_per_call"]:
                best[policy] = row
    for policy, row in best.items():
        row["ratios_to_lru"] = ratios[policy]
        row["median_ratio_to_lru"] = statistics.median(ratios[policy])
    return best


def table(best: dict[str, Any]) -> str:
    rows = []
    for policy, row in best.items():
        t = row["timing"]
        calls = t["all"]["calls"]
        mini = row["miniatures"]
        rows.append([policy, *(f"{t[m]['us_per_call']:.2f}" for m in METHODS), calls,
                     f"{t['all']['us_per_call']:.2f}",
                     f"{mini['us_per_call']:.2f}" if mini["sampled_refs"] else "-",
                     f"{t['all']['us_per_call'] * calls / row['requests']:.1f}",
                     f"{row['ratio_to_lru']:.2f}", f"{row['median_ratio_to_lru']:.2f}",
                     f"{100 * row['served_share']:.2f}"])
    return format_table(["policy", *(f"{m} us" for m in METHODS), "calls", "us/call",
                         "of it miniatures us/call", "us/request", "x LRU (same round)",
                         "x LRU (median of rounds)", "served %"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default="../shared/traces/mooncake_conversation.jsonl")
    parser.add_argument("--tokens", default="3M", help="single-tier capacity in tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--limit", type=int, default=None, help="first N requests only")
    parser.add_argument("--policies", default=",".join(EVICTION_POLICIES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    tokens = parse_size(args.tokens)
    if tokens is None:
        raise SystemExit(f"--tokens: not a token count: {args.tokens!r}")
    policies = args.policies.split(",")
    unknown = [p for p in policies if p not in EVICTION_POLICIES]
    if unknown or "lru" not in policies:
        raise SystemExit(f"--policies: need lru and known names, got {policies}")
    if args.rounds < 1:
        raise SystemExit(f"--rounds: need at least 1, got {args.rounds}")
    trace = read_trace(args.trace, 512, args.limit)
    load_before = os.getloadavg()
    best = measure(trace, tokens, policies, args.rounds)
    load_after = os.getloadavg()
    text = table(best)
    print(f"{trace.name}: {len(trace)} requests, single tier {tokens / 1e6:g}M tokens, "
          f"best of {args.rounds} rounds, load average {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after\n{text}")
    if args.json:
        write_report(args.json, "policy_cost", {"trace": trace.summary(), "tokens": tokens,
                                                "rounds": args.rounds, "policies": best,
                                                "load_average": {"before": load_before,
                                                                 "after": load_after}})


if __name__ == "__main__":
    main()
