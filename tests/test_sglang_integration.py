"""kvtier as an SGLang HiCache storage backend: runs the plug-in suite inside ``.venv-sglang``.

The suite in ``tests/sglang_suite`` drives ``kvtier.integrations.sglang`` through SGLang's own
storage factory, host pool classes and controller code (SGLang 0.5.23, its own environment; see
``plugin_env``); this test fails when that suite fails, and skips only when the environment
cannot be built on this machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from plugin_env import plugin_python, run_suite


@pytest.fixture(scope="module")
def sglang_python() -> Path:
    return plugin_python("sglang", "SGLang 0.5.23 on CPU torch")


def test_sglang_plugin_suite_passes_inside_sglang_env(sglang_python: Path) -> None:
    run_suite(sglang_python, "sglang_suite", timeout_s=600, min_tests=20)
