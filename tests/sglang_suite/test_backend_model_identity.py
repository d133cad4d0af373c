"""A fine-tune written over the base checkpoint's directory never reads the base's pages.

SGLang hands storage backends the model path as ``HiCacheStorageConfig.model_name``; with no
``model_fingerprint`` set, kvtier keys pages by that checkpoint's weights
(``kvtier.model_identity``), so the same name with other weights is another keyspace, and the
same weights again (a restart) are the same one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from sglang_helpers import fill_random, make_pool, names, page_slots


def _checkpoint(directory: Path, value: float) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                       "hidden_size": 64}))
    save_file({"w": torch.full((64, 64), value)}, str(directory / "model.safetensors"))


def test_a_fine_tune_in_the_same_directory_gets_no_page_of_the_base(backends, disk_url, tmp_path):
    model = tmp_path / "models" / "llama"
    _checkpoint(model, 1.0)
    pool = make_pool("mha", "page_first")
    fill_random(pool, seed=3)
    keys = names(4, tag="identity")
    base = backends(pool, disk_url, model=str(model))
    assert all(base.batch_set_v1(keys, page_slots(pool, [0, 1, 2, 3])))

    again = backends(make_pool("mha", "page_first"), disk_url, model=str(model))
    assert again.batch_exists(keys) == 4               # the same weights: the same pages

    _checkpoint(model, 2.0)                            # a fine-tune written over the base
    tuned = backends(make_pool("mha", "page_first"), disk_url, model=str(model))
    assert tuned.batch_exists(keys) == 0
