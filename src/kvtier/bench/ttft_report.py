"""The TTFT benchmark's report: its goals, its table and its files.

Owns ``goals`` (each goal this run measured, with its verdict: host hits at 32k and 4k tokens
against recompute, the miss-path overhead, the disk hybrid split against pure load and
recompute), ``table`` (the text table) and ``report`` (prints the table, writes JSON with
machine info, a text table beside it and the plot of ``ttft_plot``). The measurement is
``ttft``. Main thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: (tier, prefix tokens, the most TTFT may be as a share of recompute).
RATIO_GOALS = (("host", 32768, 1 / 12), ("host", 4096, 1 / 8))
MISS_OVERHEAD_GOAL = 0.02


def goals(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal that this run measured, with its verdict."""
    by_key = {(r["tier"], r["prefix_tokens"]): r for r in summary["rows"]}
    out: list[dict[str, Any]] = []
    for tier, length, share in RATIO_GOALS:
        row = by_key.get((tier, length))
        if row:
            out.append({"goal": f"{tier} hit at {length} tokens <= 1/{round(1 / share)} of recompute",
                        "tier": tier, "prefix_tokens": length, "speedup_at_least": 1 / share,
                        "measured_ratio": row["ratio_to_recompute"],
                        "met": row["ratio_to_recompute"] <= share})
    for miss in summary["miss_path"]:
        out.append({"goal": f"miss-path overhead at {miss['prefix_tokens']} tokens <= 2%",
                    "prefix_tokens": miss["prefix_tokens"], "measured_overhead": miss["overhead"],
                    "met": miss["overhead"] <= MISS_OVERHEAD_GOAL})
    for (tier, length), row in by_key.items():
        load_only = by_key.get(("disk-load", length))
        if tier == "disk" and load_only:
            best_other = min(load_only["ttft_s"], row["recompute_s"])
            out.append({"goal": f"disk hybrid at {length} tokens beats pure load and recompute",
                        "prefix_tokens": length, "hybrid_s": row["ttft_s"],
                        "load_only_s": load_only["ttft_s"], "recompute_s": row["recompute_s"],
                        "met": row["ttft_s"] < best_other})
    return out


def table(summary: dict[str, Any]) -> str:
    from kvtier.machine import format_table

    rows = [[r["tier"], r["prefix_tokens"], r["ttft_s"] * 1e3, r["recompute_s"] * 1e3,
             r["ratio_to_recompute"], r["speedup"], r["cached_tokens"] if r["cached_tokens"]
             is not None else "-", r["recomputed_hit_tokens"] if r["recomputed_hit_tokens"]
             is not None else "-"] for r in summary["rows"]]
    main = format_table(["tier", "prefix", "ttft_ms", "recompute_ms", "ratio", "speedup",
                         "cached", "recomputed_hit"], rows)
    miss = format_table(["prefix", "kvtier_on_ms", "no_cache_ms", "overhead_%"],
                        [[m["prefix_tokens"], m["kvtier_on_s"] * 1e3, m["no_cache_s"] * 1e3,
                          m["overhead"] * 100] for m in summary["miss_path"]])
    verdicts = "\n".join(f"  [{'met' if g['met'] else 'MISSED'}] {g['goal']}"
                         for g in summary.get("goals", []))
    return f"{main}\n\nmiss path (0% hits, kvtier on vs --no-cache):\n{miss}\n\ngoals:\n{verdicts}"


def report(summary: dict[str, Any], json_path: str | None, plot_path: str | None) -> int:
    """Print the table of ``summary``; write JSON (and its ``.txt`` table) to ``json_path`` and
    the plot to ``plot_path``. Returns the exit status (0)."""
    from kvtier.machine import write_report

    text = table(summary)
    print(text)
    if json_path:
        path = write_report(json_path, "ttft", summary)
        path.with_suffix(".txt").write_text(text + "\n")
    if plot_path:
        import json

        from kvtier.bench.ttft_plot import plot_ttft

        data = json.loads(Path(json_path).read_text()) if json_path else summary
        plot_ttft(data, plot_path)
    return 0
