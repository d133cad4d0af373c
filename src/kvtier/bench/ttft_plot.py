"""The TTFT benchmark's picture: time to first token per tier and prefix length, and the speedup.

Owns ``plot_ttft(result, path)``: two panels from a ``kvtier bench ttft`` result. Left, TTFT in
milliseconds against prefix length (both log scale), one line per tier, recompute in black;
right, how many times faster than recompute each tier answers, grouped by prefix length, with
the goal marks where the result carries goals. matplotlib is imported lazily (Agg backend).
Main thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLORS = {"recompute": "#222222", "device": "#1b9e77", "host": "#7570b3", "disk": "#d95f02",
          "disk-load": "#e6ab02", "redis": "#e7298a", "redis-load": "#a6761d"}


def _series(rows: list[dict[str, Any]]) -> dict[str, list[tuple[int, dict[str, Any]]]]:
    out: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for row in rows:
        out.setdefault(row["tier"], []).append((row["prefix_tokens"], row))
    for points in out.values():
        points.sort(key=lambda p: p[0])
    order = list(COLORS)
    return dict(sorted(out.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 99))


def _label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def _ttft_panel(ax: Any, series: dict[str, list[tuple[int, dict[str, Any]]]]) -> None:
    for tier, points in series.items():
        xs = [p[0] for p in points]
        ys = [p[1]["ttft_s"] * 1e3 for p in points]
        style = {"linewidth": 2.5, "linestyle": "--"} if tier == "recompute" else {"linewidth": 2}
        ax.plot(xs, ys, marker="o", color=COLORS.get(tier), label=tier, **style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted({p[0] for points in series.values() for p in points})
    ax.set_xticks(ticks, [_label(t) for t in ticks])
    ax.set_xlabel("cached prefix (tokens)")
    ax.set_ylabel("time to first token (ms, log)")
    ax.set_title("Time to first token")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(frameon=False)


def _speedup_panel(ax: Any, series: dict[str, list[tuple[int, dict[str, Any]]]],
                   goals: list[dict[str, Any]]) -> None:
    tiers = [t for t in series if t != "recompute"]
    lengths = sorted({p[0] for t in tiers for p in series[t]})
    width = 0.8 / max(len(tiers), 1)
    for i, tier in enumerate(tiers):
        by_length = dict(series[tier])
        xs = [j + (i - (len(tiers) - 1) / 2) * width for j, n in enumerate(lengths) if n in by_length]
        ys = [by_length[n]["speedup"] for n in lengths if n in by_length]
        bars = ax.bar(xs, ys, width, color=COLORS.get(tier), label=tier)
        ax.bar_label(bars, labels=[f"{y:.1f}×" for y in ys], fontsize=7, padding=1)
    labelled = False
    for goal in goals:
        if goal.get("speedup_at_least") and goal.get("prefix_tokens") in lengths:
            j = lengths.index(goal["prefix_tokens"])
            ax.hlines(goal["speedup_at_least"], j - 0.45, j + 0.45, colors="#444444",
                      linestyles=":", linewidth=1.5,
                      label=None if labelled else f"goal ({goal.get('tier', '')})")
            labelled = True
    ax.axhline(1.0, color="#222222", linewidth=1)
    ax.set_xticks(range(len(lengths)), [_label(n) for n in lengths])
    ax.set_xlabel("cached prefix (tokens)")
    ax.set_ylabel("speedup over recompute (×)")
    ax.set_title("How much sooner the first token comes")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(frameon=False, fontsize=8)


def plot_ttft(result: dict[str, Any], path: str | Path) -> Path:
    """Write the two-panel PNG for ``result`` (what ``kvtier bench ttft --json`` writes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _series(result["rows"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2))
    _ttft_panel(left, series)
    _speedup_panel(right, series, result.get("goals", []))
    setup = result.get("setup", {})
    gpu = (result.get("machine", {}).get("gpu") or {}).get("name") or result.get(
        "machine", {}).get("cpu", "")
    fig.suptitle(f"kvtier — {setup.get('model', '?')} {setup.get('dtype', '')} on "
                 f"{setup.get('device', '?')} ({gpu}), page {setup.get('page_size', '?')} tokens, "
                 f"median of {setup.get('repeats', '?')}", fontsize=11)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out
