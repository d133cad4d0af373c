"""The replay study behind ``kvtier bench replay --study DIR``.

Owns the experiment plan and its report: the served share against capacity for each policy and
the offline bound (with the LRU validation figures the trace's README publishes), the same on
held-out halves of the trace and on synthetic workloads of other shapes, write policies on a
device + host + disk hierarchy with the disk write volume, the policies' cost per call, and the
prefill GPU time each configuration saves for 8B and 70B shapes. Writes
``replay_study.json`` (with machine info), ``replay_study.txt`` (tables) and
``replay_served_vs_capacity.png`` into DIR. Main thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvtier.index.eviction import make_eviction_policy
from kvtier.machine import write_report
from kvtier.replay import synthetic
from kvtier.replay.bound import next_uses, offline_bound
from kvtier.replay.oracle import DeadFirstLRU
from kvtier.replay.savings import MODEL_SHAPES, price
from kvtier.replay.simulator import ReplayConfig, ReplayResult, replay
from kvtier.replay.timing import RecordingPolicy, time_calls
from kvtier.replay.trace import Trace

POLICIES: tuple[str, ...] = ("lru", "lrfu", "reuse", "retention", "shadow")
CURVE_TOKENS: tuple[int, ...] = (500_000, 1_000_000, 2_000_000, 3_000_000, 5_000_000,
                                 10_000_000, 20_000_000)
HALF_TOKENS: tuple[int, ...] = (1_000_000, 3_000_000, 10_000_000)
#: LRU shares the trace's README publishes (single tier), to validate the replay against.
PUBLISHED_LRU: dict[int, float] = {1_000_000: 0.054, 3_000_000: 0.138, 10_000_000: 0.291}
SYNTHETIC_FRACTIONS: tuple[float, ...] = (0.02, 0.05, 0.1, 0.2)
#: the default policy against LRU: every curve capacity on each held-out half, and these
#: shares of its unique blocks on each synthetic workload.
DEFAULT_POLICY = "shadow"
MARGIN_FRACTIONS: tuple[float, ...] = (0.01, 0.02, 0.05, 0.1, 0.2, 0.4)
TIER_CONFIGS: tuple[tuple[int, int, int], ...] = ((500_000, 1_000_000, 10_000_000),
                                                   (1_000_000, 3_000_000, 20_000_000))
#: device + host + disk as shares of a synthetic workload's unique blocks (the first
#: conversation configuration's proportions: 1 : 2 : 20).
SYNTHETIC_TIERS: tuple[float, float, float] = (0.01, 0.02, 0.2)
WRITE_POLICIES: tuple[str, ...] = ("write_through", "write_through_selective")

Progress = Callable[[Trace, str], Any]


def capacity_curve(trace: Trace, capacities: Sequence[int], bar: Progress,
                   policies: Sequence[str] = POLICIES, oracle: bool = False) -> list[dict[str, Any]]:
    """Served share per single-tier capacity for each policy and the offline bound (and, with
    ``oracle``, for LRU that knows which pages never return: ``dead_first``)."""
    uses = next_uses(trace)
    rows = []
    for tokens in capacities:
        config = ReplayConfig(tokens, block_tokens=trace.block_tokens)
        row: dict[str, Any] = {"tokens": tokens, "pages": config.pages("device")}
        for policy in policies:
            with bar(trace, f"{policy} {tokens / 1e6:g}M") as b:
                row[policy] = replay(trace, replace(config, policy=policy),
                                     progress=b.update).served_share
        if oracle:
            knows = DeadFirstLRU(trace)
            row["dead_first"] = replay(trace, config, policy_factory=lambda k=knows: k,
                                       progress=knows.advance).served_share
        row["bound"] = offline_bound(trace, row["pages"], uses).share
        rows.append(row)
    return rows


def synthetic_curves(bar: Progress, shape: synthetic.Shape) -> dict[str, Any]:
    """The capacity curve on each synthetic workload, capacities as shares of its blocks, and
    both write policies on a device + host + disk hierarchy of the same scale."""
    out: dict[str, Any] = {}
    for name in synthetic.GENERATORS:
        trace = synthetic.make(name, shape)
        blocks = trace.unique_blocks()
        tokens = [max(int(blocks * f), 1) * trace.block_tokens for f in SYNTHETIC_FRACTIONS]
        tiers = tuple(max(int(blocks * f), 2) * trace.block_tokens for f in SYNTHETIC_TIERS)
        runs = tier_runs(trace, bar, (tiers,), ("lru", "shadow"))
        out[name] = {"trace": trace.summary(), "curve": capacity_curve(trace, tokens, bar),
                     "tiers": [r.to_dict() | {"disk_write_bytes_per_s": write_rates(r, trace)}
                               for r in runs]}
    return out


def default_margin(trace: Trace, bar: Progress,
                   shape: synthetic.Shape) -> list[dict[str, Any]]:
    """The default policy's served share less LRU's at every capacity of the curve on both
    held-out halves of ``trace``, and at ``MARGIN_FRACTIONS`` of each synthetic workload's
    unique blocks: one row per (trace, capacity)."""
    cases: list[tuple[Trace, list[int]]] = [(trace.part(i, 2), list(CURVE_TOKENS))
                                            for i in range(2)]
    for name in synthetic.GENERATORS:
        made = synthetic.make(name, shape)
        cases.append((made, [max(int(made.unique_blocks() * f), 2) * made.block_tokens
                             for f in MARGIN_FRACTIONS]))
    rows = []
    for part, capacities in cases:
        for tokens in capacities:
            share = {}
            for policy in ("lru", DEFAULT_POLICY):
                config = ReplayConfig(tokens, policy=policy, block_tokens=part.block_tokens)
                with bar(part, f"margin {policy} {tokens / 1e6:g}M") as b:
                    share[policy] = replay(part, config, progress=b.update).served_share
            rows.append({"trace": part.name, "tokens": tokens, "lru": share["lru"],
                         "default": share[DEFAULT_POLICY],
                         "margin": share[DEFAULT_POLICY] - share["lru"]})
    return rows


def tier_runs(trace: Trace, bar: Progress,
              configs: Sequence[tuple[int, int, int]] = TIER_CONFIGS,
              policies: Sequence[str] = POLICIES) -> list[ReplayResult]:
    """Each policy and write policy on each device + host + disk configuration."""
    results = []
    for device, host, disk in configs:
        for write_policy in WRITE_POLICIES:
            for policy in policies:
                config = ReplayConfig(device, host, disk, policy, write_policy,
                                      trace.block_tokens)
                with bar(trace, config.label()) as b:
                    results.append(replay(trace, config, progress=b.update))
    return results


def write_rates(result: ReplayResult, trace: Trace) -> dict[str, float]:
    """Mean disk write rate over the trace's duration, bytes per second, per model shape."""
    tokens = result.written_pages["disk"] * trace.block_tokens
    seconds = max(trace.duration_s(), 1e-9)
    return {key: tokens * shape.kv_bytes_per_token / seconds
            for key, shape in MODEL_SHAPES.items()}


def single_tier_runs(trace: Trace, bar: Progress, tokens: Sequence[int]) -> list[ReplayResult]:
    results = []
    for capacity in tokens:
        for policy in POLICIES:
            config = ReplayConfig(capacity, policy=policy, block_tokens=trace.block_tokens)
            with bar(trace, config.label()) as b:
                results.append(replay(trace, config, progress=b.update))
    return results


def overhead(trace: Trace, bar: Progress, tokens: int = 3_000_000) -> dict[str, Any]:
    """Each policy's cost: per method inside a replay (``TimedPolicy``), and the best of five
    re-runs of the exact call stream the replay sent it, without the index around it."""
    out = {}
    for policy in POLICIES:
        config = ReplayConfig(tokens, policy=policy, block_tokens=trace.block_tokens)
        with bar(trace, f"timing {policy}") as b:
            result = replay(trace, config, timed=True, progress=b.update)
        recorder = RecordingPolicy(make_eviction_policy(policy))
        replay(trace, config, policy_factory=lambda r=recorder: r)
        stream = time_calls(recorder.log, lambda p=policy: make_eviction_policy(p))
        timing = (result.policy_timing or {})["device"]
        out[policy] = {"calls": timing, "replay_s": result.elapsed_s, "stream": stream,
                       "us_per_request": stream["total_ms"] * 1e3 / max(result.requests, 1),
                       "pages_evicted": result.evicted_pages["device"]}
    return out


def savings(results: Sequence[ReplayResult]) -> list[dict[str, Any]]:
    rows = []
    for result in results:
        for key, shape in MODEL_SHAPES.items():
            s = price(result.per_request, shape)
            rows.append({"config": result.config.label(), "policy": result.config.policy,
                         "write_policy": result.config.write_policy, "model": key,
                         "prefill_gpu_s": s.prefill_s, "saved_gpu_s": s.saved_s,
                         "saved_share": s.saved_share, "saved_by_tier_s": s.saved_by_tier,
                         "kv_bytes_per_token": shape.kv_bytes_per_token})
    return rows


def run_study(trace: Trace, out_dir: str | Path, progress: bool = True,
              shape: synthetic.Shape | None = None) -> dict[str, Any]:
    """Run every part of the study on ``trace`` and write the report files."""
    from kvtier.replay.progress import progress_bar
    from kvtier.replay.report import study_tables, write_plot

    def bar(t: Trace, label: str) -> Any:
        return progress_bar(len(t), label, progress)

    data: dict[str, Any] = {"trace": trace.summary(), "policies": list(POLICIES)}
    data["curve"] = capacity_curve(trace, CURVE_TOKENS, bar, oracle=True)
    data["validation"] = [{"tokens": t, "published_lru": share,
                           "replayed_lru": next(r["lru"] for r in data["curve"] if r["tokens"] == t)}
                          for t, share in PUBLISHED_LRU.items()]
    data["held_out"] = {trace.part(i, 2).name: capacity_curve(trace.part(i, 2), HALF_TOKENS, bar)
                        for i in range(2)}
    data["synthetic"] = synthetic_curves(bar, shape or synthetic.Shape())
    data["margin"] = default_margin(trace, bar, shape or synthetic.Shape())
    tiers = tier_runs(trace, bar)
    data["tiers"] = [r.to_dict() | {"disk_write_bytes_per_s": write_rates(r, trace)}
                     for r in tiers]
    data["overhead"] = overhead(trace, bar)
    data["savings"] = savings(single_tier_runs(trace, bar, (1_000_000, 3_000_000)) + tiers)
    out = Path(out_dir)
    write_report(out / "replay_study.json", "replay_study", data)
    text = study_tables(data)
    (out / "replay_study.txt").write_text(text + "\n", encoding="utf-8")
    write_plot(data, out / "replay_served_vs_capacity.png")
    print(text)
    return data

