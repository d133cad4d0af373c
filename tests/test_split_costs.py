"""The split's cost model learns each tier's fixed cost per load and stops loading when it loses."""

from __future__ import annotations

import pytest
from tests.test_engine_support import make_config, tiny_lm

from kvtier.controller.split import LineFit, RateBook
from kvtier.planner import split_hit


def test_two_load_sizes_give_the_fixed_cost_and_the_bandwidth():
    book = RateBook()
    for nbytes in (1e8, 4e8, 1e8, 4e8):
        book.observe_load("disk", int(nbytes), 0.05 + nbytes / 1e9)
    rate, fixed = book.rates["disk"]
    assert rate == pytest.approx(1e9, rel=1e-6) and fixed == pytest.approx(0.05, rel=1e-6)


def test_one_load_size_charges_the_unexplained_time_as_fixed_cost():
    book = RateBook()
    book.observe_load("disk", int(1.5e8), 0.1 + 0.1)  # 1.5 GB/s explains 0.1 s of 0.2 s
    assert book.rates["disk"] == (1.5e9, pytest.approx(0.1))
    assert LineFit().solve() is None


def test_fixed_cost_of_a_separate_forward_makes_small_splits_recompute_all():
    fast = split_hit(1024, 20000, 28000, page_size=64)
    assert 0 < fast.recompute_tokens < 1024
    costly = split_hit(1024, 20000, 28000, page_size=64, recompute_fixed_s=0.04)
    assert costly.recompute_tokens in (0, 1024)
    assert costly.time_s <= costly.recompute_all_s and costly.time_s <= costly.load_all_s


def test_engine_falls_back_to_recompute_after_slow_disk_loads(tmp_path):
    from kvtier.engine.prefix import PrefixCache
    from kvtier.engine.request import PrefillReport

    lm = tiny_lm()
    config = make_config(controller__min_prefetch_tokens=0,
                         controller__prefetch_policy="wait_complete",
                         store__disk_url=f"file://{tmp_path}/disk")
    cache = PrefixCache.build(config, lm)
    try:
        rates = cache.tiered.controller.rates
        prompt = list(range(40, 40 + 16 * 8 + 5))
        _serve(cache, prompt, PrefillReport)
        cache.drop_tiers(("device", "host"))
        rates.prefill_tokens_per_s = 1e4
        rates.rates["disk"] = (1e12, 0.0)  # believed fast: the hit is loaded whole
        report = _serve(cache, prompt, PrefillReport)
        assert report.cached_by_tier["disk"] == 128 and report.recomputed_hit_tokens == 0
        hit_bytes = 128 * lm.kv_layout(16).bytes_per_token
        for _ in range(3):  # then loads of that size are seen taking seconds
            rates.observe_load("disk", hit_bytes, 5.0)
        assert rates.rates["disk"][1] > 1.0
        cache.drop_tiers(("device", "host"))
        report = _serve(cache, prompt, PrefillReport)
        assert report.recomputed_hit_tokens == 128 and report.cached_tokens == 0
    finally:
        cache.close()


def _serve(cache, prompt, report_cls):
    report = report_cls(prompt_tokens=len(prompt))
    kv, _, state = cache.prefill(prompt, None, report)
    cache.commit_prompt(state, prompt, kv)
    cache.settle()
    return report
