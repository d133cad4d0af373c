"""The replay behind ``kvtier bench replay``: one trace through the real index, tiers and policies.

Owns ``load_trace`` (a Mooncake-format trace file, or a generated workload of ``kvtier.replay.
synthetic``), ``run`` (one replay at given tier capacities and policies, with the offline bound
at the same total capacity beside it, as a table and JSON with machine info, or the whole
study of ``kvtier.replay.study``) and ``summary_table``. The replay itself is
``kvtier.replay.simulator``. Main thread.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvtier.machine import format_table, write_report
from kvtier.replay.progress import progress_bar

DEFAULT_TRACE = "../shared/traces/mooncake_conversation.jsonl"


def load_trace(trace: str | None, synthetic_name: str | None, block_tokens: int,
               limit: int | None) -> Any:
    """The trace file ``trace`` (``DEFAULT_TRACE`` when None), its first ``limit`` requests, or
    the generated workload ``synthetic_name`` of ``limit`` requests."""
    from kvtier.replay import synthetic
    from kvtier.replay.trace import read_trace

    if synthetic_name:
        shape = synthetic.Shape(requests=limit or synthetic.Shape.requests,
                                block_tokens=block_tokens)
        return synthetic.make(synthetic_name, shape)
    return read_trace(trace or DEFAULT_TRACE, block_tokens, limit)


def run_study(trace_path: str | None, synthetic_name: str | None, block_tokens: int,
              limit: int | None, out_dir: str, progress: bool) -> int:
    """The whole study of the trace (see ``load_trace``), its ``replay_*`` results written into
    ``out_dir``. Returns the exit status (0)."""
    from kvtier.replay.study import run_study as study

    study(load_trace(trace_path, synthetic_name, block_tokens, limit), out_dir, progress=progress)
    return 0


def run(trace_path: str | None, synthetic_name: str | None, limit: int | None, *,
        device_tokens: int, host_tokens: int, disk_tokens: int, policy: str, write_policy: str,
        block_tokens: int, spread_ids: bool, bound: bool, timed: bool, progress: bool,
        json_path: str | None) -> int:
    """Replay the trace (see ``load_trace``) once, and its offline bound unless ``bound`` is
    false; prints the table, writes JSON to ``json_path``. An unknown ``policy`` fails before
    the trace is read. Returns the exit status (0)."""
    from kvtier.index.eviction import make_eviction_policy
    from kvtier.replay.bound import offline_bound
    from kvtier.replay.simulator import ReplayConfig, replay

    make_eviction_policy(policy)  # unknown names fail before the replay starts
    trace = load_trace(trace_path, synthetic_name, block_tokens, limit)
    config = ReplayConfig(device_tokens, host_tokens, disk_tokens, policy, write_policy,
                          block_tokens, spread_ids=spread_ids)
    with progress_bar(len(trace), config.label(), progress) as bar:
        result = replay(trace, config, timed=timed, progress=bar.update)
    best = None
    if bound:
        capacity = sum(config.pages(t) for t in config.tiers())
        with progress_bar(len(trace), "offline bound", progress) as bar:
            best = offline_bound(trace, capacity, progress=bar.update)
    print(summary_table(trace, result, best))
    if json_path:
        data = {"trace": trace.summary(), "result": result.to_dict(),
                "offline_bound": None if best is None else asdict(best) | {"share": best.share}}
        write_report(json_path, "replay", data)
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
