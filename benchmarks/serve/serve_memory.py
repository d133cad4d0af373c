"""Resident memory of the default ``kvtier serve`` (tiny-llama on the CPU, disk tier on), side by
side for two source trees: this one and another (an older checkout, to compare pool defaults).

Each tree's server is started as ``make run`` starts it (``kvtier serve --disk file://...``, no
other flag), made healthy, sent the same requests (a 600-token prompt twice, so the second one
hits), and measured from ``/proc/PID/status``: resident memory once healthy and after the
requests (``VmRSS``), and the peak (``VmHWM``). One server at a time, on a free port.

Run: ``python benchmarks/serve/serve_memory.py --other /tmp/old/src [--json out.json]``. Main thread.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvtier.machine import format_table, write_report

HERE = Path(__file__).resolve().parents[2] / "src"
PROMPT = " ".join(f"w{i % 97}" for i in range(300))


def _status_kib(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(src: Path, label: str) -> dict[str, Any]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.update(PYTHONPATH=str(src), KVTIER_SERVER__PORT=str(port))
    with tempfile.TemporaryDirectory() as scratch:
        cmd = [sys.executable, "-m", "kvtier", "serve", "--disk", f"file://{scratch}/disk"]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            started = time.monotonic()
            while True:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() - started > 300:
                    raise RuntimeError(f"{label}: the server did not start")
                time.sleep(0.5)
            ready_s = time.monotonic() - started
            healthy = _status_kib(proc.pid)
            body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
            cached = [httpx.post(url + "/v1/completions", json=body, timeout=120).json()
                      ["usage"]["prompt_tokens_details"]["cached_tokens"] for _ in range(2)]
            after = _status_kib(proc.pid)
        finally:
            proc.terminate()
            proc.wait(60)
    return {"tree": label, "src": str(src), "ready_s": ready_s,
            "rss_healthy_mib": healthy["VmRSS"] / 1024, "rss_after_mib": after["VmRSS"] / 1024,
            "peak_mib": after["VmHWM"] / 1024, "cached_tokens": cached}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--other", type=Path, required=True, help="Another tree's src/.")
    parser.add_argument("--other-label", default="other")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = [measure(args.other, args.other_label), measure(HERE, "this tree")]
    print(format_table(["tree", "ready s", "RSS healthy MiB", "RSS after MiB", "peak MiB",
                        "cached tokens"],
                       [[r["tree"], r["ready_s"], r["rss_healthy_mib"], r["rss_after_mib"],
                         r["peak_mib"], "/".join(map(str, r["cached_tokens"]))] for r in rows]))
    if args.json:
        write_report(args.json, "serve_memory", {"rows": rows})


if __name__ == "__main__":
    main()
