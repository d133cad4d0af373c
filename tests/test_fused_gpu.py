"""The fused element-wise kernels on the GPU: bit-identical to the torch ops they replace, so
installing them in every forward changes no stored page's bytes."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine import fused

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("rows", "width"), [(1, 14336), (4096, 14336), (37, 1000)])
def test_silu_mul_is_bit_identical_to_torch(dtype, rows, width):
    gen = torch.Generator(device="cuda").manual_seed(rows + width)
    both = (torch.randn(rows, 2 * width, device="cuda", generator=gen) * 6).to(dtype)
    for gate, up in [(both[:, :width], both[:, width:]),
                     (both[:, :width].contiguous(), both[:, width:].contiguous())]:
        want = torch.nn.functional.silu(gate) * up
        assert torch.equal(fused.silu_mul(gate, up), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotary_is_bit_identical_on_the_gpu(dtype):
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama

    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                         rope_theta=500_000.0, max_position_embeddings=1 << 17)
    rope = modeling_llama.LlamaRotaryEmbedding(config).to("cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    tokens = 4099
    qkv = (torch.randn(1, tokens, 48, 128, device="cuda", generator=gen) * 4).to(dtype)
    q, k = qkv[:, :, :32].transpose(1, 2), qkv[:, :, 32:40].transpose(1, 2)
    cos, sin = rope(q, torch.arange(7, 7 + tokens, device="cuda").unsqueeze(0))
    assert fused.rotary_fits(q, k, cos, sin)
    import inspect

    want_q, want_k = inspect.unwrap(modeling_llama.apply_rotary_pos_emb)(q, k, cos, sin)
    got_q, got_k = fused.rotary(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
