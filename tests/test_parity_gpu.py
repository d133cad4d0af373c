"""Hits against no cache on the GPU in bf16: the server's engine (batched paged attention,
captured suffix steps and decodes) gives the greedy tokens ``--no-cache`` gives on Llama,
Qwen2 and Mistral-style models, and the deterministic mode gives bit-identical logits, at page
sizes 16 and 64, from the device and the host tier. Below them, the kernels on the GPU: the
fused rotary is bit-identical to transformers', and the deterministic matmul and attention give
a row the same bits in any call."""

from __future__ import annotations

import inspect

import pytest
import torch

from kvtier.engine import attention, fused, invariant, invariant_gemm, paged
from kvtier.engine.prefix import PrefixCache
from kvtier.engine.request import GenerationRequest, PrefillReport
from kvtier.engine.service import EngineService
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


def _served(lm, page_size: int, cache: bool) -> EngineService:
    config = make_config(**{"engine.device": "cuda", "engine.dtype": "bfloat16",
                            "cache.page_size": page_size, "cache.device_pages": 512,
                            "cache.enabled": str(cache).lower(),
                            "host.pool_bytes": "32MiB" if cache else "0"})
    return EngineService.build(config, lm=lm, max_running=4)


def _generate(service: EngineService, prompt: list[int]) -> list[int]:
    return service.generate(GenerationRequest(tuple(prompt), NEW_TOKENS), timeout=300)[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("page_size", [16, 64])
def test_bf16_hits_through_the_server_engine_give_the_no_cache_tokens(arch, page_size):
    """What ``kvtier serve`` runs (the batched engine, captured suffix steps, decode graphs):
    a device hit and a host hit give ``--no-cache``'s greedy tokens."""
    lm = deterministic_lm(arch, "bfloat16", device="cuda", deterministic=False)
    paged.install(lm.model)
    prompts = [_tokens(600, seed) for seed in range(8)]
    plain = _served(lm, page_size, cache=False)
    try:
        wants = [_generate(plain, p) for p in prompts]
    finally:
        plain.close()
    cached = _served(lm, page_size, cache=True)
    drop = cached.prefix_cache.drop_tiers
    try:
        for seed, (prompt, want) in enumerate(zip(prompts, wants, strict=True)):
            cached.scheduler.call_soon(lambda: drop(("device", "host"))).result(60)
            _generate(cached, prompt[:100 + 50 * seed] + _tokens(16, 100 + seed))
            assert _generate(cached, prompt) == want, ("device", seed)
            cached.scheduler.call_soon(lambda: drop(("device",))).result(60)
            assert _generate(cached, prompt) == want, ("host", seed)
        stats = cached.engine.stats()
    finally:
        cached.close()
    assert stats["suffix_graph_steps"] >= len(prompts)   # the captured steps served the hits


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("page_size", [16, 64])
def test_deterministic_batched_steps_are_bit_identical_at_any_hit_and_batch(arch, page_size):
    """The server's steps in the deterministic mode: a prompt's last logits and its KV are the
    same bits run whole, as a hit's suffix (eager or captured) and beside another sequence."""
    from kvtier.engine.suffix_step import SuffixStep

    lm = deterministic_lm(arch, "bfloat16", device="cuda", deterministic=True)
    paged.install(lm.model)
    layout = lm.kv_layout(page_size)
    pool = torch.zeros(layout.num_layers, 2, 200, page_size, layout.num_kv_heads,
                       layout.head_dim, dtype=torch.bfloat16, device="cuda")
    prompt, other = _tokens(600, 1), _tokens(300, 2)
    per = -(-len(prompt) // page_size)
    whole, hit, beside, captured = (list(range(i * per, (i + 1) * per)) for i in range(4))
    spare = list(range(4 * per, 4 * per + -(-len(other) // page_size)))
    want = paged.forward_batch(lm, [paged.BatchRow(whole, 0, prompt)], pool)
    head = 2 * page_size
    for pages in (hit, beside, captured):
        paged.forward_batch(lm, [paged.BatchRow(pages, 0, prompt[:head])], pool)
    eager = paged.forward_batch(lm, [paged.BatchRow(hit, head, prompt[head:])], pool)
    both = paged.forward_batch(lm, [paged.BatchRow(spare, 0, other),
                                    paged.BatchRow(beside, head, prompt[head:])], pool)
    step = SuffixStep(lm, 4096, lambda: 199)
    tail = len(prompt) - 20   # bucket 32: the split launch, over three chunks of the past
    paged.forward_batch(lm, [paged.BatchRow(captured, head, prompt[head:tail])], pool)
    graphed = step.run(paged.BatchRow(captured, tail, prompt[tail:]), pool)
    assert torch.equal(eager, want) and torch.equal(both[1:], want)
    assert graphed is not None and torch.equal(graphed, want)
    for pages in (hit, beside, captured):
        assert torch.equal(pool[:, :, pages], pool[:, :, whole])


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
    # transformers' own function (a CUDA model loaded earlier installs ours in its place)
    want = inspect.unwrap(modeling_llama.apply_rotary_pos_emb)(q, k, cos, sin)
    got = fused.rotary(q, k, cos, sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_deterministic_kernels_give_a_row_the_same_bits_in_any_call():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 4096, device="cuda", generator=gen).bfloat16()
    weight = torch.randn(1024, 4096, device="cuda", generator=gen).bfloat16()
    whole = invariant.linear(x, weight, None)
    for rows in (slice(0, 1), slice(7, 8), slice(100, 300)):
        assert torch.equal(invariant.linear(x[rows], weight, None), whole[rows])
    for split in (False, True):   # prefill's fused launch and decode's split one, on any M
        assert torch.equal(invariant_gemm.matmul(x, weight, None, split=split), whole)
    query = torch.randn(1, 32, 700, 128, device="cuda", generator=gen).bfloat16()
    key = torch.randn(1, 8, 700, 128, device="cuda", generator=gen).bfloat16()
    value = torch.randn(1, 8, 700, 128, device="cuda", generator=gen).bfloat16()
    split = invariant.SPLIT_TOKENS
    prefill = attention.split_kv_attention(query, key, value, split_tokens=split)
    for past in (64, 512, 690):
        hit = attention.split_kv_attention(query[:, :, past:], key, value, split_tokens=split)
        assert torch.equal(hit, prefill[:, past:])
