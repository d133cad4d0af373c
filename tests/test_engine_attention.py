"""Split-KV attention (``kvtier.engine.attention``) against a plain softmax reference, run by the
Triton interpreter on the CPU: grouped heads, causal alignment at the end of the past, token-major
strides, one or several slices of the past; and inside a model, where it must give the logits
transformers' sdpa gives."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine import attention
from test_engine_support import tiny_lm


def reference(query, key, value, scaling):
    heads, kv_heads = query.shape[1], key.shape[1]
    key = key.repeat_interleave(heads // kv_heads, dim=1)
    value = value.repeat_interleave(heads // kv_heads, dim=1)
    m, n = query.shape[2], key.shape[2]
    scores = (query @ key.transpose(-1, -2)) * scaling
    visible = torch.arange(n)[None, :] <= (n - m + torch.arange(m))[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ value).transpose(1, 2)


def token_major(kv_heads: int, tokens: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    """``[1, kv_heads, tokens, dim]`` viewed over a ``[tokens, kv_heads, dim]`` buffer."""
    return torch.randn(tokens, kv_heads, dim, generator=gen).transpose(0, 1).unsqueeze(0)


@pytest.mark.parametrize(("heads", "kv_heads", "m", "n", "splits"), [
    (4, 2, 1, 37, 1),      # one decode step, a past that is not a block multiple
    (4, 2, 5, 130, 3),     # a few new tokens over three slices of the past
    (2, 2, 16, 16, 1),     # no past at all: plain causal
    (8, 2, 33, 200, 4),    # rows spanning several row blocks
])
def test_matches_reference(heads, kv_heads, m, n, splits):
    gen = torch.Generator().manual_seed(heads * 1000 + n)
    dim = 16
    query = torch.randn(1, heads, m, dim, generator=gen)
    key, value = token_major(kv_heads, n, dim, gen), token_major(kv_heads, n, dim, gen)
    scaling = dim ** -0.5
    got = attention.split_kv_attention(query, key, value, scaling, splits=splits)
    want = reference(query, key, value, scaling)
    assert got.shape == (1, m, heads, dim)
    assert float((got - want).abs().max()) <= 1e-5


def test_refuses_what_it_cannot_serve():
    query = torch.zeros(1, 4, 8, 16)
    with pytest.raises(ValueError, match="N >= M"):
        attention.split_kv_attention(query, torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 4, 16))
    with pytest.raises(ValueError, match="power of two"):
        attention.split_kv_attention(torch.zeros(1, 4, 1, 24), torch.zeros(1, 2, 4, 24),
                                     torch.zeros(1, 2, 4, 24))


def test_only_short_cuda_half_precision_calls_take_it():
    query, key = torch.zeros(1, 4, 8, 16), torch.zeros(1, 2, 64, 16)
    assert not attention.fits_split_kv(query, key, 0.0, {})  # CPU fp32: sdpa


def test_in_a_model_it_gives_sdpa_logits(monkeypatch):
    lm = tiny_lm()
    prompt = torch.arange(30, 100)
    plain = lm.new_cache()
    lm.forward(prompt[:60], plain)
    want = lm.forward(prompt[60:], plain, all_logits=True)
    calls = []

    def fits(query, key, dropout, kwargs):
        calls.append(query.shape[2])
        return query.shape[2] <= attention.MAX_QUERY_TOKENS and not dropout

    monkeypatch.setattr(attention, "fits_split_kv", fits)
    assert attention.install(lm.model)
    try:
        cache = lm.new_cache()
        lm.forward(prompt[:60], cache)
        got = lm.forward(prompt[60:], cache, all_logits=True)
    finally:
        lm.model.set_attn_implementation("sdpa")
    assert calls and 10 in calls
    assert float((got - want).abs().max()) <= 1e-5


@pytest.mark.parametrize(("heads", "kv_heads", "m", "past", "capacity", "splits"), [
    (4, 2, 5, 37, 200, None),   # buffers much longer than the sequence
    (8, 2, 33, 130, 512, 4),    # several row blocks, slices cut on the device
    (4, 4, 1, 0, 64, None),     # no past
])
def test_past_length_read_on_the_device(heads, kv_heads, m, past, capacity, splits):
    gen = torch.Generator().manual_seed(past + m)
    dim = 16
    query = torch.randn(1, heads, m, dim, generator=gen)
    key, value = token_major(kv_heads, capacity, dim, gen), token_major(kv_heads, capacity, dim, gen)
    key[:, :, past + m:] = 1e4   # what lies past the sequence must not count
    got = attention.split_kv_attention(query, key, value, 0.25, splits=splits,
                                       past=torch.tensor([past]))
    want = reference(query, key[:, :, :past + m], value[:, :, :past + m], 0.25)
    assert float((got - want).abs().max()) <= 1e-5


def test_inside_device_past_every_call_takes_the_kernels():
    query, key = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 40, 16)
    key[:, :, 13:] = 1e4
    with attention.device_past(torch.tensor([10])):
        got, _ = attention.kvtier_attention(None, query, key, key, None, scaling=0.25)
    want = reference(query, key[:, :, :13], key[:, :, :13], 0.25)
    assert float((got - want).abs().max()) <= 1e-5
