"""The serving benchmark's picture: throughput, TTFT and inter-token latency per server.

Owns ``plot_runs(runs, path)``: three bar panels (generated tokens/s; TTFT p50 and p99; ITL p50
and p99, in ms), one bar group per measured server (kvtier, the ``--no-cache`` baseline, or
any labelled run). matplotlib is imported lazily (Agg backend). Main thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PANELS = (("generated tokens/s", ("output_tokens_per_s",)),
          ("TTFT (ms)", ("ttft_ms_p50", "ttft_ms_p99")),
          ("inter-token latency (ms)", ("itl_ms_p50", "itl_ms_p99")))


def plot_runs(runs: dict[str, dict[str, Any]], path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(runs)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.6))
    for ax, (label, keys) in zip(axes, PANELS, strict=True):
        width = 0.8 / len(keys)
        for k, key in enumerate(keys):
            values = [runs[n].get(key) or 0.0 for n in names]
            xs = [i + (k - (len(keys) - 1) / 2) * width for i in range(len(names))]
            ax.bar(xs, values, width, label=key.rsplit("_", 1)[-1])
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax.set_title(label, fontsize=10)
        if len(keys) > 1:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
