"""``kvtier serve --write-policy write_back`` stopped with SIGTERM backs up what only memory
held: the server started again over the same disk directory serves the prompt from disk."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import httpx

from test_serve_startup import _free_port, _serve

PROMPT = {"model": "x", "prompt": "the quick brown fox jumps " * 40, "max_tokens": 2,
          "temperature": 0}


def _start(disk: Path) -> tuple[subprocess.Popen, str, list[str]]:
    port = _free_port()
    proc = _serve("--page-size", "16", "--host-pool-bytes", "8MiB", "--write-policy",
                  "write_back", "--disk", f"file://{disk}", "--store.disk_min_free_bytes", "0",
                  "--server.stats_interval_s", "0", "--served-model-name", "x", port=port)
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if "kvtier serving" in line:
            break
    return proc, f"http://127.0.0.1:{port}", lines


def _stop(proc: subprocess.Popen, lines: list[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    output = "".join(lines) + rest
    assert proc.returncode == 0, output
    return output


def test_sigterm_under_write_back_flushes_to_disk(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    proc, url, lines = _start(disk)
    try:
        usage = httpx.post(url + "/v1/completions", json=PROMPT, timeout=60).json()["usage"]
        assert usage["kvtier"]["cached_tokens_by_tier"]["disk"] == 0
        output = _stop(proc, lines)
        assert "write-back flush at close: every page the cache held is in its stores" \
            in output, output
        proc, url, lines = _start(disk)
        usage = httpx.post(url + "/v1/completions", json=PROMPT, timeout=60).json()["usage"]
        assert usage["kvtier"]["cached_tokens_by_tier"]["disk"] >= 16, usage
        _stop(proc, lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
