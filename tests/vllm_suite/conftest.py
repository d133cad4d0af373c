"""Fixtures for the vLLM plug-in suite: a tiny random Llama on disk, vLLM's scheduler with
kvtier on a disk tier.

This suite runs inside ``.venv-vllm`` (built by ``scripts/setup_vllm_env.sh``), where vLLM
0.32.0's CPU build imports; ``tests/test_vllm_integration.py`` runs it there from the main
suite. Under any other interpreter (no vLLM) these files are not collected.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
# The engine core (and so the connector's scheduler half and its counters) runs in the process
# that builds the engine; a single CPU worker then runs there too (``integrations.vllm.runtime``).
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/redis_server.py


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    return True if not HAVE_VLLM else None


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_helpers import build_model

    return build_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def scheduler(tiny_model: Path, tmp_path: Path):
    """vLLM's real Scheduler with kvtier's connector on a disk tier (``scheduler_harness``)."""
    from scheduler_harness import disk_scheduler

    sched = disk_scheduler(tiny_model, tmp_path / "disk")
    yield sched
    sched.connector.runtime.close()
