"""The README's own-server quick start, run as written against the server ``make run`` starts.

``make run`` is ``kvtier serve --disk file://<repo>/data/disk`` on port 8000; here the same
command serves on a free port with its disk tier in a temporary directory (the only changes),
as a separate process. The README's ``curl`` block (from the quick start section) is then run
with ``bash`` twice, the port rewritten, and its answers must say what the README says: the
same text both times, and the second with 64 of the prompt's 116 tokens cached. Then the admin
quick start's calls (``curl -H "$A" ...``) against a server started with the admin key, its
``kvtier serve`` flags as the README gives them but the disk directory. Needs ``curl`` (skipped
without it; ``--json`` needs curl 7.82 or newer). CPU, about 20 s.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

pytestmark = pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")


def _section(title: str) -> str:
    start = README.index(f"## {title}")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else None]


def _shell_block(section: str) -> str:
    match = re.search(r"```sh\n(.*?)```", section, re.DOTALL)
    assert match, "no sh block in the section"
    return match.group(1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def _serve(tmp_path: Path, *flags: str) -> Iterator[int]:
    """``kvtier serve`` as ``make run`` starts it, on a free port."""
    port = _free_port()
    cmd = [sys.executable, "-m", "kvtier", "serve", "--disk", f"file://{tmp_path}/disk",
           "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "KVTIER_ENGINE__DEVICE": "cpu"})
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"kvtier serve exited: {proc.stdout.read()}")  # type: ignore[union-attr]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "kvtier serve did not become healthy"
            time.sleep(0.3)
        yield port
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)


def _bash(script: str, port: int, **env: str) -> str:
    script = script.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    script = script.replace("localhost:8000", f"localhost:{port}")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_quick_start_curl_gives_what_the_readme_says(tmp_path: Path) -> None:
    section = _section("Quick start: kvtier's own server")
    block = _shell_block(section)
    claimed = re.search(r"says (\d+)\s+of the prompt's (\d+) tokens", section)
    assert claimed, "the quick start no longer says how many tokens come from the cache"
    with _serve(tmp_path) as port:
        first = json.loads(_bash(block, port))
        second = json.loads(_bash(block, port))
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    usage = second["usage"]
    assert usage["prompt_tokens"] == int(claimed.group(2))
    assert usage["prompt_tokens_details"]["cached_tokens"] == int(claimed.group(1))
    assert "kvtier" in usage


def test_the_admin_quick_start_calls_answer(tmp_path: Path) -> None:
    version = subprocess.run(["curl", "--version"], capture_output=True, text=True).stdout
    major, minor = (int(x) for x in re.match(r"curl (\d+)\.(\d+)", version).groups())  # type: ignore[union-attr]
    if (major, minor) < (7, 82):
        pytest.skip(f"curl {major}.{minor} has no --json")
    block = _shell_block(_section("Quick start: the admin API"))
    calls = [line for line in block.splitlines() if line.startswith(("A=", "curl"))]
    # Attaching a Redis needs one at that address: the other calls run as written.
    calls = [line for line in calls if "redis://" not in line]
    assert any("/admin/storage/resize" in c for c in calls) and any("/metrics" in c for c in calls)
    with _serve(tmp_path, "--server.admin_key", "sesame") as port:
        out = _bash("\n".join(calls), port, ADMIN_KEY="sesame")
    assert '"stores"' in out and '"tier":"disk"' in out                    # admin/storage
    assert '"max_bytes":17179869184' in out and '"fits":true' in out     # the resize took
    assert "kvtier_build_info" in out                                     # /metrics
