"""Captured suffix forwards on the GPU: hits served by CUDA graphs give the first token and (within
bf16 rounding of padded GEMMs) the logits of the same hits on transformers' eager forward, for
several past lengths and new-token counts on one capture per bucket."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine.graphs import BUCKETS
from kvtier.engine.prefix import PrefixCache
from kvtier.engine.request import PrefillReport
from test_engine_prefix import _prompt
from test_engine_support import make_config

pytestmark = pytest.mark.gpu


def _prefill(cache: PrefixCache, prompt: list[int]) -> tuple[torch.Tensor, list[int], int]:
    """Last logits, four greedy tokens after them, and the hit's cached tokens."""
    report = PrefillReport(len(prompt))
    kv, logits, state = cache.prefill(prompt, None, report)
    out = logits.clone()
    cache.commit_prompt(state, prompt, kv)
    tokens = [int(out.argmax())]
    for _ in range(3):
        tokens.append(int(cache.lm.forward(torch.tensor(tokens[-1:], device="cuda"), kv).argmax()))
    cache.finish(state, prompt + tokens[:-1], kv)
    cache.settle()
    return out, tokens, report.cached_tokens


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_captured_hits_match_eager_hits(model):
    from kvtier.engine.hf import load_model

    lm = load_model(model, device="cuda", dtype="bfloat16")
    config = make_config(engine__device="cuda", engine__dtype="bfloat16", cache__page_size=64,
                         cache__device_pages=256, engine__graph_tokens=2048)
    cache = PrefixCache.build(config, lm)
    graphs = cache.graphs
    assert graphs is not None
    assert graphs.captures == len(BUCKETS)  # captured when the cache was built
    try:
        for pages, new in ((2, 7), (8, 20), (20, 45), (12, 63)):  # buckets 8, 32, 64, 64
            prompt = _prompt(pages * 64 + new, pages + new)
            _prefill(cache, prompt)  # cold: fills the tiers
            results = {}
            for name, static, drop in (("graph device", graphs, False), ("eager device", None, False),
                                       ("graph host", graphs, True), ("eager host", None, True)):
                cache.graphs = static
                if drop:
                    cache.drop_tiers(("device",))
                results[name] = _prefill(cache, prompt)
            cache.graphs = graphs
            want_logits, want_tokens, cached = results["eager device"]
            assert cached == pages * 64
            for name, (logits, tokens, got_cached) in results.items():
                assert got_cached == cached, name
                assert tokens[0] == want_tokens[0], name
                gap = float((logits - want_logits).abs().max())
                assert gap <= 0.05 * float(want_logits.abs().max()), (name, gap)
        assert graphs.forwards == 8
        assert graphs.captures == len(BUCKETS)  # every past length on the captures made at start
        assert graphs.disabled is None
    finally:
        cache.close()
