"""The HF adapter, presets and KV <-> page conversion on the tiny models (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine import kv_pages
from kvtier.engine.hf import load_model
from kvtier.engine.presets import PRESETS, TOKENIZER_DIR, resolve_model
from kvtier.errors import ConfigError, LayoutMismatch
from test_engine_support import tiny_lm


def _prompt(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(5, 1000, (n,), generator=gen)


def test_presets_name_real_shapes_and_ship_a_tokenizer():
    llama = PRESETS["llama3-8b-shape"].config
    assert (llama["num_hidden_layers"], llama["num_key_value_heads"], llama["head_dim"]) == (32, 8, 128)
    qwen = PRESETS["qwen2.5-7b-shape"].config
    assert (qwen["num_hidden_layers"], qwen["num_key_value_heads"], qwen["model_type"]) == (28, 4, "qwen2")
    assert (TOKENIZER_DIR / "tokenizer.json").is_file()
    assert resolve_model("tiny-qwen2").is_preset


def test_unknown_model_is_refused_with_the_presets_named(tmp_path):
    with pytest.raises(ConfigError, match="tiny-llama"):
        resolve_model(str(tmp_path / "missing"))


def test_fingerprint_is_stable_and_names_architecture_and_seed():
    llama, qwen = tiny_lm("tiny-llama"), tiny_lm("tiny-qwen2")
    again = load_model("tiny-llama", device="cpu", dtype="float32", seed=0)
    other_seed = load_model("tiny-llama", device="cpu", dtype="float32", seed=1)
    assert again.fingerprint == llama.fingerprint
    assert len({llama.fingerprint, qwen.fingerprint, other_seed.fingerprint}) == 3


def test_kv_layout_matches_what_the_model_puts_in_its_cache():
    lm = tiny_lm()
    cache = lm.new_cache()
    lm.forward(_prompt(20), cache)
    keys, values = kv_pages.cache_layer_kv(cache, 0)
    layout = lm.kv_layout(16)
    assert keys.shape == (1, layout.num_kv_heads, 20, layout.head_dim) == values.shape
    assert len(cache.layers) == layout.num_layers


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_split_forward_matches_one_forward(name):
    lm, tokens = tiny_lm(name), _prompt(50)
    whole = lm.forward(tokens, lm.new_cache(), all_logits=True)
    cache = lm.new_cache()
    lm.forward(tokens[:30], cache)
    tail = lm.forward(tokens[30:], cache, all_logits=True)
    assert torch.allclose(tail, whole[30:], atol=1e-5)


def test_pages_round_trip_through_a_device_pool_in_any_page_order():
    lm, tokens, page = tiny_lm(), _prompt(70), 16
    layout = lm.kv_layout(page)
    pool = torch.zeros(layout.num_layers, 2, 8, page, layout.num_kv_heads, layout.head_dim)
    source = lm.new_cache()
    lm.forward(tokens, source)
    kv_pages.write_pages(source, pool, 16, [6, 1, 3])        # tokens 16..64
    rebuilt = lm.new_cache()
    assert kv_pages.append_pages(rebuilt, pool, [6, 1, 3]) == 48
    for layer in range(layout.num_layers):
        for got, want in zip(kv_pages.cache_layer_kv(rebuilt, layer),
                             kv_pages.cache_layer_kv(source, layer), strict=True):
            assert torch.equal(got[0], want[0, :, 16:64])


def test_logits_from_pages_equal_logits_from_recompute():
    lm, tokens, page = tiny_lm("tiny-qwen2"), _prompt(40), 8
    layout = lm.kv_layout(page)
    pool = torch.zeros(layout.num_layers, 2, 6, page, layout.num_kv_heads, layout.head_dim)
    cache = lm.new_cache()
    want = lm.forward(tokens, cache)
    kv_pages.write_pages(cache, pool, 0, [5, 4, 3, 2])
    reused = lm.new_cache()
    kv_pages.append_pages(reused, pool, [5, 4, 3, 2])
    got = lm.forward(tokens[32:], reused)
    assert torch.argmax(got) == torch.argmax(want)
    assert torch.allclose(got, want, atol=1e-5)


def test_pool_of_the_wrong_shape_is_refused():
    lm = tiny_lm()
    layout = lm.kv_layout(16)
    good = torch.zeros(layout.num_layers, 2, 4, 16, layout.num_kv_heads, layout.head_dim)
    kv_pages.check_pool(good, layout.num_layers, layout.num_kv_heads, layout.head_dim, lm.dtype)
    with pytest.raises(LayoutMismatch):
        kv_pages.check_pool(good[:, :, :, :, :1], layout.num_layers, layout.num_kv_heads,
                            layout.head_dim, lm.dtype)


def test_writing_pages_past_the_cached_tokens_is_refused():
    lm = tiny_lm()
    layout = lm.kv_layout(16)
    pool = torch.zeros(layout.num_layers, 2, 4, 16, layout.num_kv_heads, layout.head_dim)
    cache = lm.new_cache()
    lm.forward(_prompt(20), cache)
    with pytest.raises(ValueError, match="cache holds 20 tokens"):
        kv_pages.write_pages(cache, pool, 16, [0])
