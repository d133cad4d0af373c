"""Split-KV attention's numerics in the Triton interpreter (CPU): in bf16 it stays as close to
an fp64 softmax as torch's sdpa does (fp32 sums, one rounding at the end: only the order of the
sums differs); with fixed slices (``split_tokens``, the deterministic mode) a query's output is
bit-identical whether it runs in a prefill of every query, after a past of any length, in
chunks of queries, or over longer buffers with the past's length read on the device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtier.engine import attention, invariant


def _inputs(heads, kv_heads, m, n, dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    query = (torch.randn(1, heads, m, dim, generator=gen) * 2).to(dtype)
    # token-major, as the engine's caches hold them
    key = (torch.randn(n, kv_heads, dim, generator=gen) * 2).to(dtype).transpose(0, 1)[None]
    value = torch.randn(n, kv_heads, dim, generator=gen).to(dtype).transpose(0, 1)[None]
    return query, key, value


def _sdpa(query, key, value):
    """torch's sdpa with the bottom-right causal mask, ``[1, M, heads, dim]``."""
    m, n = query.shape[2], key.shape[2]
    visible = torch.arange(n)[None, :] <= (n - m + torch.arange(m))[:, None]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=visible, enable_gqa=True)
    return out.transpose(1, 2)


@pytest.mark.parametrize(("heads", "kv_heads", "m", "n", "dim", "splits"), [
    (8, 2, 5, 300, 64, 4),      # a hit: a few new tokens over four slices of the past
    (7, 1, 16, 200, 64, 2),     # Qwen2-style 7:1 grouping
    (4, 4, 3, 130, 128, 1),     # head_dim 128, one slice
])
def test_bf16_error_is_that_of_sdpa(heads, kv_heads, m, n, dim, splits):
    query, key, value = _inputs(heads, kv_heads, m, n, dim, torch.bfloat16, heads * n + dim)
    exact = _sdpa(query.double(), key.double(), value.double())
    ours = attention.split_kv_attention(query, key, value, splits=splits)
    theirs = _sdpa(query, key, value)
    assert ours.dtype == torch.bfloat16
    our_error = float((ours.double() - exact).abs().max())
    their_error = float((theirs.double() - exact).abs().max())
    ulp = torch.finfo(torch.bfloat16).eps * float(exact.abs().max())
    # both round an fp32 result once; what differs is the order of the sums (and where the
    # probabilities, rounded to bf16 for the second product, were normalized)
    assert our_error <= their_error + ulp
    assert float((ours.double() - theirs.double()).abs().max()) <= 2 * ulp


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 64), (7, 1, 64), (2, 1, 128)])
def test_fixed_slices_give_a_query_the_same_bits_in_any_call(dtype, heads, kv_heads, dim):
    n, split = 150, 64   # three slices, the last one partial
    query, key, value = _inputs(heads, kv_heads, n, n, dim, dtype, heads + dim)
    prefill = attention.split_kv_attention(query, key, value, split_tokens=split)
    for past in (16, 64, 131, 149):   # any hit length, page-aligned or not
        suffix = attention.split_kv_attention(query[:, :, past:], key, value, split_tokens=split)
        assert torch.equal(suffix, prefill[:, past:]), past
    # the first 70 queries alone, over only the keys they can see
    head = attention.split_kv_attention(query[:, :, :70], key[:, :, :70], value[:, :, :70],
                                        split_tokens=split)
    assert torch.equal(head, prefill[:, :70])
    # longer buffers, the past's length read from a tensor (the captured path)
    room = torch.zeros(1, kv_heads, 256, dim, dtype=dtype)
    long_key, long_value = room.clone(), room.clone()
    long_key[:, :, :n], long_value[:, :, :n] = key, value
    on_device = attention.split_kv_attention(query[:, :, 140:], long_key, long_value,
                                             past=torch.tensor([140]), split_tokens=split)
    assert torch.equal(on_device, prefill[:, 140:])


def test_fixed_slices_stay_close_to_sdpa():
    query, key, value = _inputs(4, 2, 40, 200, 64, torch.float32, 3)
    ours = attention.split_kv_attention(query, key, value, split_tokens=64)
    assert float((ours - _sdpa(query, key, value)).abs().max()) <= 1e-5


def test_deterministic_attention_runs_long_prompts_in_chunks_alike(monkeypatch):
    query, key, value = _inputs(2, 1, 100, 100, 64, torch.bfloat16, 5)
    whole, _ = invariant.attention_forward(None, query, key, value, None)
    # a partial-results budget of a few queries: the prefill runs in many launches
    monkeypatch.setattr(invariant, "PARTIAL_BYTES", 2 * 1 * 64 * 4 * 30)
    chunked, _ = invariant.attention_forward(None, query, key, value, None)
    assert torch.equal(chunked, whole)
    with pytest.raises(ValueError, match="dropout"):
        invariant.attention_forward(None, query, key, value, None, dropout=0.1)


def test_split_tokens_must_be_whole_blocks():
    query, key, value = _inputs(2, 1, 4, 64, 64, torch.float32, 1)
    with pytest.raises(ValueError, match="multiple of 64"):
        attention.split_kv_attention(query, key, value, split_tokens=48)
