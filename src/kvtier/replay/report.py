"""Text tables and the plot of a replay study (``kvtier.replay.study``'s output).

Owns ``study_tables`` (plain fixed-width tables, one per part of the study) and ``write_plot``
(served share against capacity for each policy and the offline bound, as a PNG; matplotlib is
imported lazily, and the plot is skipped with a note when it is missing). Main thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.machine import format_table


def _pct(x: float) -> str:
    return f"{100 * x:.2f}"


def _curve_table(rows: list[dict[str, Any]], policies: list[str]) -> str:
    extra = ["dead_first"] if rows and "dead_first" in rows[0] else []
    headers = ["tokens", "pages", *(f"{p} %" for p in policies),
               *("LRU knowing dead pages %" for _ in extra), "offline bound %"]
    body = [[f"{r['tokens'] / 1e6:.3g}M", r["pages"], *(_pct(r[p]) for p in [*policies, *extra]),
             _pct(r["bound"])] for r in rows]
    return format_table(headers, body)


def _tiers_table(tiers: list[dict[str, Any]]) -> str:
    rows = []
    for r in tiers:
        cfg = r["config"]
        rows.append([r["label"], cfg["policy"], cfg["write_policy"],
                     *(_pct(r["share_by_tier"][t]) for t in ("device", "host", "disk")),
                     _pct(r["served_share"]), r["written_pages"]["host"],
                     r["written_pages"]["disk"], r["written_pages"]["disk"] * cfg["block_tokens"],
                     *(f"{r['disk_write_bytes_per_s'][m] / 1e9:.2f}" for m in ("8b", "70b"))])
    return format_table(["tiers", "policy", "write policy", "device %", "host %", "disk %",
                         "all %", "host writes (pages)", "disk writes (pages)",
                         "disk writes (tokens)", "8B disk GB/s", "70B disk GB/s"], rows)


def _overhead_table(overhead: dict[str, Any]) -> str:
    rows = []
    for policy, o in overhead.items():
        calls, stream = o["calls"], o["stream"]
        rows.append([policy, *(f"{calls[m]['us_per_call']:.2f}" for m in
                               ("touch", "add", "remove", "pop_victim")),
                     stream["calls"], f"{stream['us_per_call']:.2f}",
                     f"{o['us_per_request']:.1f}", f"{o['replay_s']:.1f}"])
    return format_table(["policy", "touch us", "add us", "remove us", "pop_victim us",
                         "calls", "us/call (best of 5)", "us/request", "replay s"], rows)


def _margin_table(rows: list[dict[str, Any]]) -> str:
    """The default policy against LRU, one line per trace: its worst and best margin."""
    by_trace: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_trace.setdefault(r["trace"], []).append(r)
    body = []
    for name, runs in by_trace.items():
        worst = min(runs, key=lambda r: r["margin"])
        best = max(runs, key=lambda r: r["margin"])
        body.append([name, len(runs), f"{100 * worst['margin']:+.2f}",
                     f"{worst['tokens'] / 1e6:.3g}M", f"{100 * best['margin']:+.2f}",
                     f"{best['tokens'] / 1e6:.3g}M"])
    return format_table(["trace", "capacities", "worst (points)", "at", "best (points)",
                         "at"], body)


def _savings_table(savings: list[dict[str, Any]]) -> str:
    rows = [[s["config"], s["policy"], s["write_policy"], s["model"],
             f"{s['prefill_gpu_s']:.0f}", f"{s['saved_gpu_s']:.0f}", _pct(s["saved_share"]),
             *(f"{s['saved_by_tier_s'][t]:.0f}" for t in ("device", "host", "disk"))]
            for s in savings]
    return format_table(["tiers", "policy", "write policy", "model", "prefill GPU s",
                         "saved GPU s", "saved %", "device s", "host s", "disk s"], rows)


def study_tables(data: dict[str, Any]) -> str:
    """Every table of a study, with a title line each."""
    policies = data["policies"]
    trace = data["trace"]
    parts = [f"trace {trace['name']}: {trace['requests']} requests, {trace['input_tokens']} "
             f"input tokens, infinite-capacity share {_pct(trace['infinite_share'])} %",
             "\nServed share vs capacity (single tier):", _curve_table(data["curve"], policies),
             "\nValidation against the published LRU figures:",
             format_table(["tokens", "published %", "replayed %"],
                          [[f"{v['tokens'] / 1e6:g}M", _pct(v["published_lru"]),
                            _pct(v["replayed_lru"])] for v in data["validation"]])]
    for name, rows in data["held_out"].items():
        parts += [f"\nHeld-out part {name}:", _curve_table(rows, policies)]
    for name, body in data["synthetic"].items():
        parts += [f"\nSynthetic workload {name} ({body['trace']['requests']} requests, "
                  f"{body['trace']['unique_blocks']} unique blocks):",
                  _curve_table(body["curve"], policies)]
        if body.get("tiers"):
            parts += [f"Write policies on {name}:", _tiers_table(body["tiers"])]
    if data.get("margin"):
        worst = min(data["margin"], key=lambda r: r["margin"])
        parts += [f"\nDefault policy less LRU (served share, points) at {len(data['margin'])} "
                  f"capacities; worst {100 * worst['margin']:+.2f} ({worst['trace']}, "
                  f"{worst['tokens'] / 1e6:.3g}M):", _margin_table(data["margin"])]
    parts += ["\nWrite policies on device + host + disk:", _tiers_table(data["tiers"]),
              "\nPolicy overhead (single tier, 3M tokens): per method inside the timed replay, and "
              "the replay's exact call stream re-run alone:",
              _overhead_table(data["overhead"]),
              "\nPrefill GPU time saved over the whole trace (H200 cost model):",
              _savings_table(data["savings"])]
    return "\n".join(parts)


def _curves(data: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]], float | None]]:
    """(title, rows, infinite share) of every capacity curve in a study, the main one first."""
    out = [(data["trace"]["name"], data["curve"], data["trace"]["infinite_share"])]
    out += [(name, rows, None) for name, rows in data.get("held_out", {}).items()]
    out += [(body["trace"]["name"], body["curve"], body["trace"].get("infinite_share"))
            for body in data.get("synthetic", {}).values()]
    return out


def _panel(ax: Any, title: str, rows: list[dict[str, Any]], policies: list[str],
           infinite: float | None) -> None:
    x = [r["tokens"] / 1e6 for r in rows]
    names = [*policies, *(["dead_first"] if "dead_first" in rows[0] else []), "bound"]
    labels = {"bound": "offline bound (Belady)",
              "dead_first": "LRU that knows which pages never return (oracle)"}
    order = [*policies, "dead_first", "bound"]   # one colour per series in every panel
    for name in names:
        ax.plot(x, [100 * r[name] for r in rows], marker="o", markersize=3,
                label=labels.get(name, name), color=f"C{order.index(name) % 10}",
                linestyle={"bound": "--", "dead_first": ":"}.get(name, "-"))
    if infinite is not None:
        ax.axhline(100 * infinite, color="grey", linewidth=0.8, label="infinite capacity")
    ax.set_xscale("log")
    ax.set_xticks(x, [f"{v:.2g}M" for v in x], fontsize=7)
    ax.minorticks_off()
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.tick_params(axis="y", labelsize=7)


def write_plot(data: dict[str, Any], path: str | Path) -> Path | None:
    """Served share vs capacity for each policy and the offline bound, one panel per trace
    (the main trace, its held-out halves, each synthetic workload)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}")
        return None
    curves = _curves(data)
    cols = 3
    rows = -(-len(curves) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), dpi=110,
                             squeeze=False)
    for ax, (title, body, infinite) in zip(axes.flat, curves, strict=False):
        _panel(ax, title, body, data["policies"], infinite)
    for ax in list(axes.flat)[len(curves):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.supylabel("input tokens served from cache (%)", fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.text(0.5, 0.055, "cache capacity (tokens, single tier)", ha="center", fontsize=9)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
