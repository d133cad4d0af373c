"""Split-KV attention on the GPU: the kernels against an fp32 reference at real model shapes, and a
model served with them against the same model on transformers' sdpa."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine import attention
from test_engine_attention import reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("m", "n"), [(1, 4096), (32, 4128), (32, 32800), (128, 1000), (7, 7)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernels_match_fp32_reference(m, n, dtype):
    gen = torch.Generator(device="cuda").manual_seed(n + m)
    heads, kv_heads, dim = 32, 8, 128
    query = torch.randn(1, heads, m, dim, device="cuda", generator=gen).to(dtype)
    buffer = torch.randn(2, n + 64, kv_heads, dim, device="cuda", generator=gen).to(dtype)
    key = buffer[0, :n].transpose(0, 1).unsqueeze(0)    # token-major, as RoomyLayer holds it
    value = buffer[1, :n].transpose(0, 1).unsqueeze(0)
    got = attention.split_kv_attention(query, key, value, dim ** -0.5)
    want = reference(query.float().cpu(), key.float().cpu(), value.float().cpu(), dim ** -0.5)
    assert got.dtype == dtype
    assert float((got.float().cpu() - want).abs().max()) <= 2e-2


def test_a_model_on_split_kv_matches_sdpa():
    from kvtier.engine import paged
    from kvtier.engine.hf import load_model

    lm = load_model("tiny-llama", device="cuda", dtype="bfloat16", attention="kvtier")
    # kvtier's attention, wrapped by the batched engine's paged attention (kvtier's outside a step)
    assert lm.model.config._attn_implementation == f"{paged.NAME}_kvtier"
    vocab = int(lm.config.vocab_size)
    prompt = torch.arange(40, 1100, device="cuda") * 7 % vocab
    results = {}
    for name in ("kvtier", "sdpa"):
        lm.model.set_attn_implementation(name)
        cache = lm.new_cache()
        lm.forward(prompt[:1000], cache)
        results[name] = lm.forward(prompt[1000:], cache, all_logits=True)
    gap = float((results["kvtier"] - results["sdpa"]).abs().max())
    scale = float(results["sdpa"].abs().max())
    assert gap <= 0.02 * scale
