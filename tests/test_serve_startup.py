"""``kvtier serve`` starting and stopping as a user runs it (a separate process each time).

Settings that cannot take effect and a port in use are refused before the model loads; the
"serving at" banner comes only once the port accepts; the log summarizes the tiers, has one line
per request and a stats line; stopping mid-stream ends the stream with an error event and
``[DONE]``, without a traceback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

BANNER = "kvtier serving tiny-llama at"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(*flags: str, port: int | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["KVTIER_SERVER__PORT"] = str(port or _free_port())
    cmd = [sys.executable, "-m", "kvtier", "serve", "--engine.device", "cpu", *flags]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _refused(*flags: str, port: int | None = None) -> tuple[int, str, float]:
    started = time.monotonic()
    proc = _serve(*flags, port=port)
    output, _ = proc.communicate(timeout=120)
    return proc.returncode, output, time.monotonic() - started


def test_plain_path_for_disk_is_refused_before_the_model_loads(tmp_path):
    code, output, _ = _refused("--disk", str(tmp_path / "disk"))
    assert code == 2, output
    assert "--disk (store.disk_url)" in output and f"file://{tmp_path}/disk" in output
    assert "engine ready" not in output and "'store url'" not in output


def test_disk_tier_without_a_host_pool_is_refused_naming_both_settings(tmp_path):
    code, output, _ = _refused("--disk", f"file://{tmp_path}/disk", "--host-pool-bytes", "0")
    assert code == 2, output
    assert "--host-pool-bytes (host.pool_bytes)" in output and "--disk (store.disk_url)" in output
    assert "engine ready" not in output


def test_port_in_use_fails_fast_without_a_banner():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        code, output, _ = _refused("--cache.device_pages", "64", port=port)
    assert code == 2, output
    assert "--port (server.port)" in output and "in use" in output
    assert BANNER not in output and "engine ready" not in output


@pytest.fixture(scope="module")
def stopped_mid_stream(tmp_path_factory):
    """One server: banner, a cached request, a stream stopped by SIGINT. Returns what it saw."""
    port = _free_port()
    disk = tmp_path_factory.mktemp("disk")
    proc = _serve("--disk", f"file://{disk}", "--page-size", "16", "--host-pool-bytes", "8MiB",
                  "--server.stats_interval_s", "0.5", port=port)
    seen: dict = {"lines": []}
    try:
        for line in proc.stdout:
            seen["lines"].append(line)
            if line.startswith(BANNER):
                break
        with socket.socket() as probe:  # at once: the banner promises a listening port
            seen["connect"] = probe.connect_ex(("127.0.0.1", port))
        url = f"http://127.0.0.1:{port}"
        body = {"model": "tiny-llama", "prompt": "x " * 40, "max_tokens": 2, "temperature": 0}
        for _ in range(2):
            httpx.post(url + "/v1/completions", json=body, timeout=60).raise_for_status()
        time.sleep(1.2)  # a stats interval with the requests in it
        long = {**body, "max_tokens": 20000, "ignore_eos": True, "stream": True}
        events: list[str] = []
        with httpx.stream("POST", url + "/v1/completions", json=long, timeout=60) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:
                    proc.send_signal(signal.SIGINT)  # one Ctrl-C: a second one forces the exit
        seen["events"] = events
    finally:
        if proc.poll() is None and "events" not in seen:
            proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    seen["output"] = "".join(seen["lines"]) + rest
    seen["code"] = proc.returncode
    return seen


def test_banner_is_printed_only_once_the_port_accepts(stopped_mid_stream):
    assert stopped_mid_stream["connect"] == 0, stopped_mid_stream["output"]


def test_stop_mid_stream_sends_an_error_event_and_done_without_a_traceback(stopped_mid_stream):
    events, output = stopped_mid_stream["events"], stopped_mid_stream["output"]
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert "shutting down" in error["message"] and error["code"] == "ShuttingDown"
    assert "Traceback" not in output and "CancelledError" not in output, output
    assert stopped_mid_stream["code"] == 0, output


def test_log_summarizes_tiers_and_has_request_and_stats_lines(stopped_mid_stream):
    output = stopped_mid_stream["output"]
    assert "tiers: device " in output and "host 256 pages" in output
    assert "disk file://" in output and "pages found" in output and "remote off" in output
    request_lines = [line for line in output.splitlines() if "kvtier.requests" in line]
    assert len(request_lines) == 3, output
    assert "cached 32: device 32" in request_lines[1] and "TTFT" in request_lines[1]
    assert ": error," in request_lines[2]
    assert any("kvtier.stats" in line and "generation" in line and "hit rate" in line
               for line in output.splitlines()), output
