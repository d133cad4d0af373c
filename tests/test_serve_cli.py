"""``kvtier serve`` as a user starts it: a separate process, flags, the printed how-to, shutdown."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvtier.commands.serve import how_to_call
from kvtier.config import build_config


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"kvtier serve exited early: {proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError("kvtier serve did not become healthy")


def test_kvtier_serve_runs_with_the_disk_tier_and_stops_on_interrupt(tmp_path):
    port = _free_port()
    env = {**os.environ, "KVTIER_SERVER__PORT": str(port)}
    cmd = [sys.executable, "-m", "kvtier", "serve", "--engine.device", "cpu",
           "--disk", f"file://{tmp_path}/disk", "--host-pool-bytes", "8MiB",
           "--cache.device_pages", "64", "--page-size", "16"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        body = {"model": "tiny-llama", "prompt": "x " * 40, "max_tokens": 2, "temperature": 0}
        first = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        again = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert first["choices"][0]["text"] == again["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    finally:
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    assert f"kvtier serving tiny-llama at {url}" in output
    assert "/v1/completions" in output


def test_how_to_call_mentions_the_key_only_when_one_is_set():
    open_config = build_config(env={})
    keyed = build_config(env={}, flags={"server.api_key": "k"})
    assert "Authorization" not in how_to_call("http://h:1", open_config, "m")
    assert "Authorization: Bearer $KEY" in how_to_call("http://h:1", keyed, "m")


def test_make_run_passes_args_to_kvtier_serve():
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    root = Path(__file__).resolve().parents[1]
    dry = subprocess.run(["make", "-n", "-C", str(root), "run",
                          "ARGS=--port 9000 --log-level debug"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    serve = [line for line in dry.splitlines() if "kvtier serve" in line]
    assert serve and serve[-1].endswith("--port 9000 --log-level debug"), dry


def test_banner_says_how_to_get_the_openai_client_and_sends_a_prompt_longer_than_a_page():
    from transformers import AutoTokenizer

    from kvtier.commands.serve import DEMO_PROMPT
    from kvtier.engine.presets import resolve_model
    from kvtier.engine.text import encode_prompt

    banner = how_to_call("http://h:1", build_config(env={}, flags={}), "m")
    assert "pip install openai" in banner and DEMO_PROMPT in banner
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("tiny-llama").tokenizer_dir)
    assert len(encode_prompt(tokenizer, DEMO_PROMPT)) > 64  # a whole default page is cached


def test_serve_loads_the_model_with_every_engine_setting(monkeypatch):
    """``engine.deterministic`` and ``engine.prefill_attention`` reach the model ``kvtier
    serve`` loads (the model decides its kernels at load)."""
    from kvtier.engine import hf
    from kvtier.serve import lifecycle

    seen = {}

    class Loaded(Exception):
        pass

    def load_model(model, **kwargs):
        seen.update(kwargs, model=model)
        raise Loaded

    monkeypatch.setattr(hf, "load_model", load_model)
    config = build_config(env={}, flags={"server.port": "0", "engine.deterministic": "true",
                                         "engine.prefill_attention": "triton"})
    with pytest.raises(Loaded):
        lifecycle.serve(config)
    assert seen["deterministic"] == "true" and seen["prefill_attention"] == "triton"
    assert seen["model"] == config.engine.model
