"""Machine facts for benchmark reports: CPU, memory, OS, Python, library versions, GPU.

Owns ``machine_info()`` and ``write_report()``, used by every benchmark so that each JSON result
says where it was measured. Imports torch lazily (only if it is installed). Main thread.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from importlib import metadata
from pathlib import Path
from typing import Any


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _gpu() -> dict[str, Any] | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "count": torch.cuda.device_count(),
            "memory_bytes": props.total_memory, "cuda": torch.version.cuda}


def machine_info() -> dict[str, Any]:
    """A snapshot of the machine a benchmark ran on."""
    return {
        "host": socket.gethostname(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "os": platform.platform(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "mem_total_bytes": _mem_total_bytes(),
        "python": platform.python_version(),
        "versions": {n: _version(n) for n in ("kvtier", "torch", "numpy", "triton",
                                              "transformers", "redis", "hiredis")},
        "gpu": _gpu(),
    }


def write_report(path: str | Path, name: str, data: dict[str, Any]) -> Path:
    """Write ``data`` plus machine info as JSON to ``path``; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": name, "machine": machine_info(), **data}
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return out


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A plain fixed-width text table."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)
