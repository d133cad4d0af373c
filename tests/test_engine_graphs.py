"""The static suffix forward (``kvtier.engine.graphs``) run eagerly on the CPU: after a device or
host hit it gives the tokens and logits of a cold run, pads new tokens up to a bucket, leaves
the sequence's cache ready for decode, waits for each layer's own copy, and refuses (counted)
what it cannot serve. On CUDA the same steps are captured as graphs (tests/test_graphs_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine import graphs
from test_engine_cache_matrix import TOLERANCE, build, check, reference, through
from test_engine_overlap import LazyCopy
from test_engine_prefix import _prompt
from test_engine_support import tiny_lm


def with_graphs(prefix_cache, capacity: int = 512):
    prefix_cache.graphs = graphs.SuffixGraphs(prefix_cache.lm, capacity, capture=False)
    return prefix_cache.graphs


@pytest.mark.parametrize(("model", "page_size", "extra"), [
    ("tiny-llama", 16, 7),     # 7 new tokens run padded to 8
    ("tiny-qwen2", 16, 9),     # 9 -> 16
    ("tiny-llama", 32, 0),     # the prompt is all pages: the last one runs again (crop)
])
def test_device_and_host_hits_match_a_cold_run(model, page_size, extra, tmp_path):
    lm = tiny_lm(model)
    prefix_cache = build(lm, page_size, tmp_path)
    static = with_graphs(prefix_cache)
    try:
        prompt = _prompt(4 * page_size + extra, page_size + extra)
        want = reference(lm, prompt)
        cached = 4 * page_size - (0 if extra else 1)
        check("cold", want, through(prefix_cache, prompt), None, 0)
        assert static.forwards == 0 and static.fallbacks["not_a_fresh_hit"] == 1
        check("device hit", want, through(prefix_cache, prompt), "device", cached)
        assert static.forwards == 1
        prefix_cache.drop_tiers(("device",))
        check("host hit", want, through(prefix_cache, prompt), "host", cached)
        assert static.forwards == 2
    finally:
        prefix_cache.close()


def test_each_layer_waits_for_its_own_copy_in_order(tmp_path):
    prefix_cache = build(tiny_lm(), 16, tmp_path)
    static = with_graphs(prefix_cache)
    lazy = LazyCopy(prefix_cache.tiered.ctx.copy)
    prefix_cache.tiered.ctx.copy = lazy
    try:
        prompt = _prompt(75, 4)
        want = reference(prefix_cache.lm, prompt)
        through(prefix_cache, prompt)
        prefix_cache.drop_tiers(("device",))
        got = through(prefix_cache, prompt)
        assert static.forwards == 1
        assert lazy.waits == list(range(lazy.num_layers))
        assert got.tokens == want.tokens
        assert float((got.logits - want.logits).abs().max()) <= TOLERANCE
    finally:
        prefix_cache.close()


def test_what_it_cannot_serve_runs_eagerly_and_is_counted(tmp_path):
    prefix_cache = build(tiny_lm(), 16, tmp_path)
    static = with_graphs(prefix_cache, capacity=graphs.MAX_QUERY_TOKENS)
    try:
        long_prompt = _prompt(8 * 16 + 3, 5)   # a 128-token hit + 3 new: past the capacity
        want = reference(prefix_cache.lm, long_prompt)
        through(prefix_cache, long_prompt)
        check("too long", want, through(prefix_cache, long_prompt), "device", 128)
        # the cold run: 131 new tokens; the hit: 3 new tokens past the capacity
        assert static.fallbacks == {"new_tokens": 1, "too_long": 1} and static.forwards == 0

        rest = _prompt(16 + graphs.MAX_QUERY_TOKENS + 1, 6)  # a 16-token hit, 129 new tokens
        through(prefix_cache, rest[:16])
        check("many new tokens", reference(prefix_cache.lm, rest), through(prefix_cache, rest),
              "device", 16)
        assert static.fallbacks == {"new_tokens": 2, "too_long": 1, "not_a_fresh_hit": 1}
        assert static.forwards == 0
        assert prefix_cache.stats()["graphs"]["static_kv_bytes"] == 0  # nothing allocated yet
        static.warm()
        stats = prefix_cache.stats()["graphs"]
        assert stats["fallbacks"]["too_long"] == 1
        lm = prefix_cache.lm  # the static KV: capacity x layers x K and V x heads x dim x 4 bytes
        assert stats["static_kv_bytes"] == (graphs.MAX_QUERY_TOKENS * lm.config.num_hidden_layers
                                            * 2 * lm.num_kv_heads * lm.head_dim * 4)
    finally:
        prefix_cache.close()


def test_a_failed_capture_disables_graphs_and_changes_nothing(tmp_path, monkeypatch):
    prefix_cache = build(tiny_lm(), 16, tmp_path)
    static = with_graphs(prefix_cache)
    static.capture = True

    def broken(steps):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(static, "_capture", broken)
    try:
        prompt = _prompt(40, 7)
        want = reference(prefix_cache.lm, prompt)
        through(prefix_cache, prompt)
        check("after a failed capture", want, through(prefix_cache, prompt), "device", 32)
        assert static.disabled.startswith("RuntimeError")
        assert static.fallbacks["capture_failed"] == 1
        through(prefix_cache, prompt)
        assert static.fallbacks["disabled"] == 1 and static.forwards == 0
    finally:
        prefix_cache.close()


def test_buckets_and_support():
    assert [graphs.bucket_for(n) for n in (1, 8, 9, 33, 128)] == [8, 8, 16, 64, 128]
    assert graphs.unsupported_reason(tiny_lm()) is None
    assert graphs.unsupported_reason(tiny_lm("tiny-qwen2")) is None


def test_static_kv_writes_at_the_device_positions():
    kv = torch.zeros(1, 2, 16, 2, 4)
    slots = torch.tensor([5, 6])
    static_kv = graphs._StaticKV(kv, slots)
    keys = torch.ones(1, 2, 2, 4)
    got_keys, _ = static_kv.update(keys, 2 * keys, 0)
    assert got_keys.shape == (1, 2, 16, 4)
    assert kv[0, 0, 5:7].eq(1).all() and kv[0, 1, 5:7].eq(2).all()
    assert kv[0, :, :5].eq(0).all() and kv[0, :, 7:].eq(0).all()


def test_the_sequence_cache_holds_every_position_after_the_static_forward(tmp_path):
    from kvtier.engine import kv_pages
    from kvtier.engine.request import PrefillReport

    lm = tiny_lm()
    prefix_cache = build(lm, 16, tmp_path)
    static = with_graphs(prefix_cache)
    try:
        prompt = _prompt(3 * 16 + 5, 8)
        through(prefix_cache, prompt)
        kv, _, state = prefix_cache.prefill(prompt, None, PrefillReport(len(prompt)))
        assert static.forwards == 1
        want = lm.new_cache()
        lm.forward(torch.tensor(prompt), want)
        for layer in range(lm.config.num_hidden_layers):
            keys, values = kv_pages.cache_layer_kv(kv, layer)
            assert keys.shape[2] == len(prompt)
            assert float((keys - want.layers[layer].keys).abs().max()) <= TOLERANCE
            assert float((values - want.layers[layer].values).abs().max()) <= TOLERANCE
        prefix_cache.commit_prompt(state, prompt, kv)
        prefix_cache.finish(state, prompt, kv)
    finally:
        prefix_cache.close()


def test_warm_builds_every_bucket_once(tmp_path):
    prefix_cache = build(tiny_lm(), 16, tmp_path)
    static = with_graphs(prefix_cache)
    built = []
    make_steps = static._make_steps
    static._make_steps = lambda bucket: built.append(bucket) or make_steps(bucket)
    try:
        static.warm()
        static.warm()
        assert built == list(graphs.BUCKETS)
        prompt = _prompt(40, 9)
        want = reference(prefix_cache.lm, prompt)
        through(prefix_cache, prompt)
        check("after warm", want, through(prefix_cache, prompt), "device", 32)
        assert built == list(graphs.BUCKETS) and static.forwards == 1
    finally:
        prefix_cache.close()


def test_static_buffers_that_do_not_fit_turn_the_graphs_off(tmp_path, monkeypatch):
    prefix_cache = build(tiny_lm(), 16, tmp_path)
    static = with_graphs(prefix_cache)

    def no_memory():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")

    monkeypatch.setattr(static, "_allocate", no_memory)
    try:
        static.warm()
        assert static.disabled.startswith("static buffers: CUDA out of memory")
        assert static.fallbacks["no_memory"] == 1
        prompt = _prompt(40, 10)
        want = reference(prefix_cache.lm, prompt)
        through(prefix_cache, prompt)
        check("graphs off", want, through(prefix_cache, prompt), "device", 32)
        assert static.forwards == 0 and static.fallbacks["disabled"] == 2
    finally:
        prefix_cache.close()
