"""Fixtures for the SGLang plug-in suite: real SGLang host pools, storage configs and backends.

This suite runs inside ``.venv-sglang`` (built by ``scripts/setup_sglang_env.sh``), where SGLang
0.5.23 imports on the CPU; ``tests/test_sglang_integration.py`` runs it there from the main
suite. Under any other interpreter (no SGLang) these files are not collected.
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    return True if not HAVE_SGLANG else None


if HAVE_SGLANG:
    with warnings.catch_warnings():  # SGLang's import chain warns about torch.jit and CUDA
        warnings.simplefilter("ignore")
        from sglang_helpers import make_config


@pytest.fixture
def disk_url(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'disk'}"


@pytest.fixture
def backends() -> Iterator[Callable[..., Any]]:
    """A factory: ``backends(pool, url, tp_rank=0, tp_size=1, mla=False, **kvtier)`` returns a
    backend built by SGLang's own storage factory (``dynamic``) and registered with ``pool``."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    made: list[Any] = []

    def build(pool: Any, url: str, *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False,
              interface_v1: int = 1, model: str = "test/model", pp_rank: int = 0,
              pp_size: int = 1, **kvtier: Any) -> Any:
        extra = {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
                 "class_name": "KvtierHiCacheStorage", "interface_v1": interface_v1,
                 "kvtier": {"disk_url": url, "disk_min_free_bytes": 0, **kvtier}}
        json.dumps(extra)  # SGLang reads it from a JSON command-line flag
        config = make_config(tp_rank=tp_rank, tp_size=tp_size, mla=mla, extra=extra, model=model,
                             pp_rank=pp_rank, pp_size=pp_size)
        backend = StorageBackendFactory.create_backend("dynamic", config, pool)
        backend.register_mem_pool_host(pool)
        made.append(backend)
        return backend

    yield build
    for backend in made:
        backend.close()
