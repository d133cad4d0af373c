"""Running a plug-in's suite inside the isolated environment of the engine it plugs into.

SGLang and vLLM pin their own torch, transformers and friends, so each lives in a virtual
environment of its own, built by ``scripts/setup_<name>_env.sh`` (``make test`` builds both; a
test builds it on demand, a no-op when already built). ``plugin_python`` builds it or skips the
calling test saying why; ``run_suite`` runs a suite there and fails when the suite fails or ran
fewer tests than it holds.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _clean_env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def plugin_python(name: str, what: str) -> Path:
    """The python of ``.venv-<name>`` (built by ``scripts/setup_<name>_env.sh``); skips the test
    when the environment cannot be built here. ``what`` names the engine for the skip reason."""
    venv = ROOT / f".venv-{name}"
    build = subprocess.run(["bash", str(ROOT / "scripts" / f"setup_{name}_env.sh"), str(venv)],
                           capture_output=True, text=True, timeout=1200, env=_clean_env(venv),
                           stdin=subprocess.DEVNULL)
    if build.returncode != 0:
        pytest.skip(f"cannot build .venv-{name} ({what}) here:\n"
                    + _tail(build.stdout + build.stderr, 15))
    return venv / "bin" / "python"


def run_suite(python: Path, suite: str, *, timeout_s: int, min_tests: int) -> None:
    """Run ``tests/<suite>`` with ``python``; assert it passed with at least ``min_tests``."""
    venv = python.parent.parent
    run = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-W", "ignore::DeprecationWarning", str(ROOT / "tests" / suite)],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, env=_clean_env(venv),
        stdin=subprocess.DEVNULL)
    output = run.stdout + run.stderr
    sys.stdout.write(_tail(output, 5) + "\n")
    assert run.returncode == 0, f"{suite} failed:\n" + _tail(output, 80)
    passed = re.search(r"(\d+) passed", output)
    assert passed and int(passed.group(1)) >= min_tests, "the suite ran too few tests:\n" + _tail(output)
