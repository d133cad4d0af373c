"""The fused kernels round where transformers rounds (Triton interpreter, CPU, bf16/fp16/fp32):
``rotary`` is bit-identical to ``apply_rotary_pos_emb`` with cos/sin from the model's own
``rotary_emb``; ``rms_norm`` is bit-identical to ``LlamaRMSNorm`` on every row where both see
the same fp32 inverse RMS (the sum's order and rsqrt's last bit are the backend's), and within
two units in the last place elsewhere; a row's result never depends on the other rows."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2

from kvtier.engine import fused

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _rope(config_cls, head_dim: int, theta: float):
    config = config_cls(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                        rope_theta=theta, max_position_embeddings=1 << 17)
    home = modeling_llama if config_cls is LlamaConfig else modeling_qwen2
    rotary_cls = getattr(home, config_cls.__name__.replace("Config", "RotaryEmbedding"))
    return rotary_cls(config), home.apply_rotary_pos_emb


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("config_cls", "head_dim", "heads", "kv_heads", "tokens", "start"), [
    (LlamaConfig, 64, 8, 2, 37, 0),          # GQA 4:1 from the first position
    (LlamaConfig, 128, 4, 4, 9, 70_000),     # large positions: cos/sin far from 1
    (Qwen2Config, 64, 7, 1, 16, 513),        # Qwen2's copy of the function, 7:1 GQA
])
def test_rotary_is_bit_identical_to_transformers(dtype, config_cls, head_dim, heads, kv_heads,
                                                 tokens, start):
    rope, apply = _rope(config_cls, head_dim, 500_000.0)
    gen = torch.Generator().manual_seed(head_dim + tokens)
    # laid out as the projections leave them: [1, tokens, heads, dim] seen heads-first
    q = (torch.randn(1, tokens, heads, head_dim, generator=gen) * 4).to(dtype).transpose(1, 2)
    k = (torch.randn(1, tokens, kv_heads, head_dim, generator=gen) * 4).to(dtype).transpose(1, 2)
    cos, sin = rope(q, torch.arange(start, start + tokens).unsqueeze(0))
    assert cos.dtype == dtype and fused.rotary_fits(q, k, cos, sin)
    want_q, want_k = apply(q, k, cos, sin)
    got_q, got_k = fused.rotary(q, k, cos, sin)
    assert got_q.dtype == want_q.dtype == dtype
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def _norm(hidden: int, dtype: torch.dtype, eps: float, gen: torch.Generator):
    norm = modeling_llama.LlamaRMSNorm(hidden, eps=eps).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=gen) * 2 + 0.25)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden", "eps"), [(48, 64, 1e-6), (16, 896, 1e-6),
                                                     (8, 4096, 1e-5)])
def test_rms_norm_rounds_where_transformers_rounds(dtype, rows, hidden, eps):
    gen = torch.Generator().manual_seed(rows * hidden)
    norm = _norm(hidden, dtype, eps, gen)
    x = (torch.randn(1, rows, hidden, generator=gen) * 3).to(dtype)
    with torch.no_grad():
        want = norm(x)
        got = fused.rms_norm(x, norm.weight, eps)
        # The fp32 x * rsqrt(mean(x^2) + eps) each side computes, before any rounding: the
        # kernel's from an fp32 input and unit fp32 weight (one exact multiply by 1).
        x32 = x.float()
        theirs = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ours = fused.rms_norm(x32, torch.ones(hidden), eps)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    same_scale = (ours == theirs).all(-1)[0]
    assert int(same_scale.sum()) >= rows // 2, "the inverse RMS should mostly agree"
    assert torch.equal(got[0, same_scale], want[0, same_scale])
    ulp = 2 * torch.finfo(dtype).eps * want.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert bool(((got.float() - want.float()).abs() <= ulp).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_rows_do_not_depend_on_their_neighbours(dtype):
    gen = torch.Generator().manual_seed(7)
    norm = _norm(256, dtype, 1e-6, gen)
    x = (torch.randn(40, 256, generator=gen) * 2).to(dtype)
    whole = fused.rms_norm(x, norm.weight, 1e-6)
    for start, stop in [(0, 1), (3, 4), (5, 21), (39, 40)]:
        assert torch.equal(fused.rms_norm(x[start:stop], norm.weight, 1e-6), whole[start:stop])


def test_install_norms_stays_through_fused_modules(monkeypatch):
    import inspect

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb",   # transformers' own function
                        inspect.unwrap(modeling_llama.apply_rotary_pos_emb))
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=50)
    model = modeling_llama.LlamaForCausalLM(config)
    count = fused.install_norms(model)
    assert count == 2 * 2 + 1
    with fused.fused_modules(model) as replaced:
        assert replaced == 1   # only the rotary function: the norms are installed already
    assert "forward" in model.model.norm.__dict__
    x = torch.randn(1, 3, 64)
    assert torch.equal(model.model.norm(x), fused.rms_norm(x, model.model.norm.weight,
                                                           model.model.norm.variance_epsilon))


def _ulps(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    scale = want.float().abs().clamp_min(torch.finfo(dtype).tiny)
    return (got.float() - want.float()).abs() / (torch.finfo(dtype).eps * scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "width", "fused_rows"), [(7, 96, False), (33, 1500, False),
                                                          (5, 2048, True)])
def test_silu_mul_rounds_where_torch_rounds(dtype, rows, width, fused_rows):
    gen = torch.Generator().manual_seed(rows + width)
    if fused_rows:   # gate and up as the two halves of one [rows, 2 * width] projection
        both = (torch.randn(rows, 2 * width, generator=gen) * 4).to(dtype)
        gate, up = both[:, :width], both[:, width:]
    else:
        gate = (torch.randn(1, rows, width, generator=gen) * 4).to(dtype)
        up = (torch.randn(1, rows, width, generator=gen) * 4).to(dtype)
    want = torch.nn.functional.silu(gate) * up
    got = fused.silu_mul(gate, up)
    assert got.dtype == dtype and got.shape == want.shape
    # The interpreter's exp is numpy's, the CPU's torch its own: the fp32 SiLU may differ in
    # its last bits, so in 16 bits a few elements round the other way, and fp32 results differ
    # by a few ulps (the GPU test wants every element equal).
    if dtype != torch.float32:
        assert float((got == want).float().mean()) >= 0.98
    assert bool((_ulps(got, want, dtype) <= 4.0).all())


def test_silu_mul_refuses_shapes_that_differ():
    with pytest.raises(ValueError, match="differ"):
        fused.silu_mul(torch.ones(2, 3), torch.ones(2, 4))


def _tiny_llama(**extra):
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=50, **extra)
    torch.manual_seed(0)
    return modeling_llama.LlamaForCausalLM(config).eval()


def test_install_mlps_runs_silu_mul_in_every_mlp(monkeypatch):
    model = _tiny_llama()
    mlp = model.model.layers[1].mlp
    x = torch.randn(1, 5, 64)
    with torch.no_grad():
        want = type(mlp).forward(mlp, x)
        assert fused.install_mlps(model) == 2
        calls = []
        real = fused.silu_mul
        monkeypatch.setattr(fused, "silu_mul", lambda g, u: calls.append(1) or real(g, u))
        got = mlp(x)
    assert calls == [1]
    assert float((got - want).abs().max()) <= 1e-5
    # an MLP with another activation keeps transformers' forward
    assert fused.install_mlps(_tiny_llama(hidden_act="gelu")) == 0


def test_install_rotary_is_for_good_and_only_once(monkeypatch):
    import inspect

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb",
                        inspect.unwrap(modeling_llama.apply_rotary_pos_emb))
    original = modeling_llama.apply_rotary_pos_emb
    model = _tiny_llama()
    assert fused.install_rotary(model) == 1
    installed = modeling_llama.apply_rotary_pos_emb
    assert installed is not original and installed.__wrapped__ is original
    assert fused.install_rotary(model) == 0   # never wrapped twice
    with fused.fused_modules(model) as replaced:
        assert replaced == 2 * 2 + 1          # the norms only: the rotary function is ours
        assert modeling_llama.apply_rotary_pos_emb is installed
    assert modeling_llama.apply_rotary_pos_emb is installed
