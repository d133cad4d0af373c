"""Hits against no cache on the GPU in bf16: the default fast path (kvtier attention, fused
kernels, captured graphs) gives the greedy tokens a recompute gives on Llama and Qwen2-style
models, and the deterministic mode gives bit-identical logits, at page sizes 16 and 64, from the
device and the host tier. Below them, the kernels on the GPU: the fused rotary is bit-identical
to transformers', and the deterministic matmul and attention give a row the same bits in any
call."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine import attention, fused, invariant
from kvtier.engine.prefix import PrefixCache
from kvtier.engine.request import PrefillReport
from test_deterministic import _through, _tokens, deterministic_lm
from test_engine_support import make_config

pytestmark = pytest.mark.gpu
NEW_TOKENS = 24


def _greedy(lm, kv, logits):
    tokens, steps = [int(torch.argmax(logits))], [logits]
    while len(tokens) < NEW_TOKENS:
        logits = lm.forward(torch.tensor(tokens[-1:], device="cuda"), kv)
        tokens.append(int(torch.argmax(logits)))
        steps.append(logits)
    return tokens, torch.stack(steps)


def _hits(lm, page_size: int, deterministic: bool):
    """(no-cache run, device-hit run, host-hit run) for each of 8 prompts sharing prefixes."""
    config = make_config(engine__device="cuda", engine__dtype="bfloat16",
                         cache__page_size=page_size, cache__device_pages=512,
                         engine__deterministic=str(deterministic).lower())
    cache = PrefixCache.build(config, lm)
    runs = []
    try:
        for seed in range(8):
            prompt = _tokens(600, seed)
            kv = lm.new_cache()
            want = _greedy(lm, kv, lm.forward(torch.tensor(prompt, device="cuda"), kv))
            cache.drop_tiers(("device", "host"))
            _through(cache, prompt[:100 + 50 * seed] + _tokens(16, 100 + seed))
            got = []
            for drop in ((), ("device",)):   # a device hit, then a host hit
                if drop:
                    cache.drop_tiers(drop)
                kv, logits, state = cache.prefill(prompt, None, PrefillReport(len(prompt)))
                cache.commit_prompt(state, prompt, kv)
                got.append(_greedy(lm, kv, logits))
                cache.finish(state, prompt, kv)
                cache.settle()
            runs.append((want, *got))
    finally:
        cache.close()
    return runs


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("page_size", [16, 64])
def test_bf16_hits_give_the_no_cache_tokens(arch, page_size):
    lm = deterministic_lm(arch, "bfloat16", device="cuda", deterministic=False)
    for want, device_hit, host_hit in _hits(lm, page_size, deterministic=False):
        assert device_hit[0] == want[0] and host_hit[0] == want[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("page_size", [16, 64])
def test_deterministic_hits_are_bit_identical(arch, page_size):
    lm = deterministic_lm(arch, "bfloat16", device="cuda", deterministic=True)
    for want, device_hit, host_hit in _hits(lm, page_size, deterministic=True):
        assert device_hit[0] == want[0] and torch.equal(device_hit[1], want[1])
        assert host_hit[0] == want[0] and torch.equal(host_hit[1], want[1])


def test_rotary_on_the_gpu_is_bit_identical_to_transformers():
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama

    rope = modeling_llama.LlamaRotaryEmbedding(LlamaConfig(
        hidden_size=4096, num_attention_heads=32, head_dim=128, rope_theta=500000.0)).cuda()
    q = torch.randn(1, 77, 32, 128, device="cuda").bfloat16().transpose(1, 2)
    k = torch.randn(1, 77, 8, 128, device="cuda").bfloat16().transpose(1, 2)
    cos, sin = rope(q, torch.arange(4000, 4077, device="cuda").unsqueeze(0))
    want = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    got = fused.rotary(q, k, cos, sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_deterministic_kernels_give_a_row_the_same_bits_in_any_call():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 4096, device="cuda", generator=gen).bfloat16()
    weight = torch.randn(1024, 4096, device="cuda", generator=gen).bfloat16()
    whole = invariant.linear(x, weight, None)
    for rows in (slice(0, 1), slice(7, 8), slice(100, 300)):
        assert torch.equal(invariant.linear(x[rows], weight, None), whole[rows])
    query = torch.randn(1, 32, 700, 128, device="cuda", generator=gen).bfloat16()
    key = torch.randn(1, 8, 700, 128, device="cuda", generator=gen).bfloat16()
    value = torch.randn(1, 8, 700, 128, device="cuda", generator=gen).bfloat16()
    split = invariant.SPLIT_TOKENS
    prefill = attention.split_kv_attention(query, key, value, split_tokens=split)
    for past in (64, 512, 690):
        hit = attention.split_kv_attention(query[:, :, past:], key, value, split_tokens=split)
        assert torch.equal(hit, prefill[:, past:])
