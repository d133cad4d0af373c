"""Model presets: the embedded tiny models and random-weight models with real shapes.

Owns ``PRESETS`` (name -> ``Preset``) and ``resolve_model``, which turns the ``engine.model``
setting into a ``ModelSource``: a preset (config built here, random weights from a seed, the
tokenizer shipped in ``assets/tokenizer``) or a Hugging Face model directory. No torch import;
called on the main thread at start-up.

The ``*-shape`` presets copy the published shapes of known models (layers, heads, KV heads, head
size, MLP width, vocabulary, RoPE base) so that a GPU benchmark measures the real compute and KV
sizes without downloading weights. Their outputs are meaningless; their speed is real.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError

ASSETS = Path(__file__).with_name("assets")
TOKENIZER_DIR = ASSETS / "tokenizer"


@dataclass(frozen=True)
class Preset:
    """A named model built from a config with random weights."""

    name: str
    description: str
    config: dict[str, Any] = field(repr=False)


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a preset's config, or a directory of weights."""

    name: str
    config: dict[str, Any] | None
    path: Path | None
    tokenizer_dir: Path

    @property
    def is_preset(self) -> bool:
        return self.path is None


def _asset_config(name: str) -> dict[str, Any]:
    return json.loads((ASSETS / f"{name}.json").read_text(encoding="utf-8"))


def _shape_config(base: str, **shape: Any) -> dict[str, Any]:
    """A full-size config: the tiny model's special tokens, the real model's shape."""
    config = _asset_config(base)
    config.update(shape)
    return config


def _build_presets() -> dict[str, Preset]:
    llama8b = _shape_config(
        "tiny-llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5)
    qwen7b = _shape_config(
        "tiny-qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6)
    presets = [
        Preset("tiny-llama", "4-layer Llama-style model (GQA 4:2, 128 wide); the default.",
               _asset_config("tiny-llama")),
        Preset("tiny-qwen2", "4-layer Qwen2-style model (q/k/v biases, GQA 4:2).",
               _asset_config("tiny-qwen2")),
        Preset("llama3-8b-shape", "Llama-3-8B shapes (32 layers, 8 KV heads), random weights.",
               llama8b),
        Preset("qwen2.5-7b-shape", "Qwen2.5-7B shapes (28 layers, 4 KV heads), random weights.",
               qwen7b),
    ]
    return {p.name: p for p in presets}


PRESETS: dict[str, Preset] = _build_presets()


def resolve_model(model: str) -> ModelSource:
    """A preset by name, or a Hugging Face model directory (``config.json`` inside)."""
    if model in PRESETS:
        preset = PRESETS[model]
        return ModelSource(preset.name, dict(preset.config), None, TOKENIZER_DIR)
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        allowed = "a preset (" + ", ".join(PRESETS) + ") or a directory holding config.json"
        raise ConfigError("engine.model", model, allowed)
    has_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model",
                                                          "tokenizer_config.json"))
    return ModelSource(path.name, None, path, path if has_tokenizer else TOKENIZER_DIR)
