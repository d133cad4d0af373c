"""The connector's default ``model_fingerprint``, from vLLM's own ``VllmConfig``: a checkpoint
written over another of the same name and architecture gets other page keys; the same
checkpoint copied to another directory gets the same fingerprint; dummy weights are named by
their config; a fingerprint given by hand wins."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from vllm_helpers import build_model

from kvtier.integrations.vllm.fingerprint import model_fingerprint


def _config(model: Path, load_format: str = "auto") -> Any:
    from vllm.config import LoadConfig, ModelConfig, VllmConfig

    return VllmConfig(model_config=ModelConfig(model=str(model), dtype="float32", seed=0,
                                               max_model_len=512),
                      load_config=LoadConfig(load_format=load_format))


def test_default_fingerprint_follows_the_weights(tmp_path: Path) -> None:
    model = build_model(tmp_path / "m", seed=0)
    base = model_fingerprint(_config(model), "")
    assert base.startswith("ckpt:")
    shutil.copytree(model, tmp_path / "copy")
    assert model_fingerprint(_config(tmp_path / "copy"), "") == base
    (model / "model.safetensors").unlink()
    build_model(model, seed=1)  # a fine-tune of the same architecture, same directory
    tuned = model_fingerprint(_config(model), "")
    assert tuned.startswith("ckpt:") and tuned != base
    dummy = model_fingerprint(_config(model, "dummy"), "")
    assert dummy.startswith("dummy:") and dummy == model_fingerprint(
        _config(tmp_path / "copy", "dummy"), "")
    assert model_fingerprint(_config(model), "mine") == "mine"
