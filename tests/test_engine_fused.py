"""Fused RMSNorm and rotary kernels (``kvtier.engine.fused``) in the Triton interpreter: the same
values as transformers' modules, and ``fused_modules`` swaps them in and puts everything back."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

from kvtier.engine import fused
from test_engine_support import tiny_lm


def test_rms_norm_matches_the_module():
    lm = tiny_lm()
    norm = lm.model.model.layers[0].input_layernorm
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(norm.weight.shape, generator=gen) + 0.5)
        x = torch.randn(1, 7, lm.config.hidden_size, generator=gen) * 3
        want = type(norm).forward(norm, x)
        got = fused.rms_norm(x, norm.weight, norm.variance_epsilon)
        strided = fused.rms_norm(x.transpose(0, 1), norm.weight, norm.variance_epsilon)
        norm.weight.fill_(1.0)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert float((got - want).abs().max()) <= 1e-5
    assert float((strided.transpose(0, 1) - want).abs().max()) <= 1e-5


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_rotary_matches_transformers(model):
    lm = tiny_lm(model)
    attn = lm.model.model.layers[0].self_attn
    home = sys.modules[type(attn).__module__]
    gen = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, dim = 5, lm.config.num_attention_heads, lm.num_kv_heads, lm.head_dim
    # as the projections leave them: [1, tokens, heads, dim] seen heads-first
    q = torch.randn(1, tokens, heads, dim, generator=gen).transpose(1, 2)
    k = torch.randn(1, tokens, kv_heads, dim, generator=gen).transpose(1, 2)
    positions = torch.arange(100, 100 + tokens).unsqueeze(0)
    cos, sin = lm.model.model.rotary_emb(q, positions)
    assert fused.rotary_fits(q, k, cos, sin)
    want_q, want_k = home.apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = fused.rotary(q, k, cos, sin)
    assert float((got_q - want_q).abs().max()) <= 1e-5
    assert float((got_k - want_k).abs().max()) <= 1e-5


def test_fused_modules_swaps_in_and_restores(monkeypatch):
    lm = tiny_lm()
    model = lm.model
    attn = model.model.layers[0].self_attn
    home = sys.modules[type(attn).__module__]
    # transformers' own function, even if a CUDA model loaded earlier installed ours for good
    monkeypatch.setattr(home, "apply_rotary_pos_emb", inspect.unwrap(home.apply_rotary_pos_emb))
    original = home.apply_rotary_pos_emb
    norm = model.model.norm
    calls = []
    real = fused.rms_norm
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused, "rms_norm", lambda *a: calls.append(1) or real(*a))
        with fused.fused_modules(model) as replaced:
            assert replaced == 2 * lm.config.num_hidden_layers + 1 + 1
            assert home.apply_rotary_pos_emb is not original
            norm(torch.ones(1, 2, lm.config.hidden_size))
            assert calls == [1]
            q = torch.randn(1, 2, 3, lm.head_dim)
            cos = torch.ones(1, 3, lm.head_dim)
            # a shape the kernel does not take still goes to transformers' function
            want = original(q, q, cos.unsqueeze(1), cos.unsqueeze(1), unsqueeze_dim=2)
            got = home.apply_rotary_pos_emb(q, q, cos.unsqueeze(1), cos.unsqueeze(1),
                                            unsqueeze_dim=2)
            assert torch.equal(got[0], want[0])
    assert home.apply_rotary_pos_emb is original
    assert "forward" not in norm.__dict__
    norm(torch.ones(1, 2, lm.config.hidden_size))
    assert calls == [1]
