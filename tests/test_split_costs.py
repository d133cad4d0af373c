"""The split's cost model learns each tier's fixed cost per load and stops loading when it loses."""

from __future__ import annotations

import copy

import pytest
from tests.test_engine_support import make_config, tiny_lm

from kvtier.controller.rates import LineFit, RateBook
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


def _disk_hit(tmp_path):
    """A prefix cache with a disk tier, an engine and a prompt whose 8 pages only the disk
    holds (device and host dropped)."""
    from kvtier.engine.prefix import PrefixCache
    from kvtier.engine.request import PrefillReport

    lm = tiny_lm()
    config = make_config(controller__min_prefetch_tokens=0,
                         controller__prefetch_policy="wait_complete",
                         store__disk_url=f"file://{tmp_path}/disk",
                         engine__store_hit_split="plan")   # the planner's split, measured here
    cache = PrefixCache.build(config, lm)
    prompt = list(range(40, 40 + 16 * 8 + 5))
    _serve(cache, prompt, PrefillReport)
    cache.drop_tiers(("device", "host"))
    return lm, cache, prompt, cache.tiered.controller.rates


def test_engine_falls_back_to_recompute_after_slow_disk_loads(tmp_path):
    from kvtier.engine.request import PrefillReport

    lm, cache, prompt, rates = _disk_hit(tmp_path)
    try:
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


def test_superlinear_prefills_are_fitted_and_make_long_splits_recompute_more():
    book = RateBook()
    for tokens in (4096, 16384, 32768, 4096, 16384, 32768):
        book.observe_prefill(tokens, 0.01 + 2.7e-5 * tokens + 4.3e-10 * tokens * tokens)
    a, b, c = book.prefill_curve.solve()
    assert a == pytest.approx(0.01, abs=1e-4)
    assert b == pytest.approx(2.7e-5, rel=1e-3) and c == pytest.approx(4.3e-10, rel=1e-3)
    timed = book.prefill_time()
    linear = split_hit(32768, 6200, 32768 / timed(32768), page_size=64)
    curved = split_hit(32768, 6200, 32768 / timed(32768), page_size=64, prefill_time=timed)
    # the head of a long prompt is cheaper than its share of the whole: recompute more of it
    assert curved.recompute_tokens > linear.recompute_tokens
    assert curved.time_s < curved.recompute_all_s == pytest.approx(timed(32768))
    head = curved.recompute_tokens
    crossing = [r for r in range(0, 32768, 64) if timed(r) > (32768 - r) / 6200][0]
    assert head in (crossing - 64, crossing)  # the split point: both finish about together


def test_prefills_of_one_length_do_not_give_a_curve():
    book = RateBook()
    for _ in range(5):
        book.observe_prefill(4096, 0.12)
    assert book.prefill_time() is None


#: What ``plan_split`` reads from the rate book besides the splits' lateness.
PLANNING_STATE = ("rates", "prefill_tokens_per_s", "prefill_fixed_s", "prefill_fit",
                  "prefill_curve")


def test_a_split_that_ran_late_makes_hits_of_that_size_recompute(tmp_path):
    from kvtier.engine.request import PrefillReport

    lm, cache, prompt, rates = _disk_hit(tmp_path)
    try:
        rates.rates["disk"] = (lm.kv_layout(16).bytes_per_token * 5000.0, 0.0)
        rates.prefill_tokens_per_s = 5000.0  # loading as slow as recomputing: split in half
        planned = {name: copy.deepcopy(getattr(rates, name)) for name in PLANNING_STATE}
        report = _serve(cache, prompt, PrefillReport)
        assert 0 < report.recomputed_hit_tokens < 128
        assert set(rates.split_errors) == {128 .bit_length()}  # the split was timed
        rates.observe_split(128, 0.0128, 0.2)  # then splits of this size are seen running late
        cache.drop_tiers(("device", "host"))
        # The serve above measured this machine's disk and prefill: put back what the split
        # was planned on, so that only the lateness differs between the two decisions.
        for name, value in planned.items():
            setattr(rates, name, value)
        report = _serve(cache, prompt, PrefillReport)
        assert report.recomputed_hit_tokens == 128 and report.cached_tokens == 0
        rates.observe_split(2048, 0.1, 0.5)  # another size's lateness does not count here
        assert rates.split_error(128) == pytest.approx(rates.split_errors[8])
    finally:
        cache.close()


def test_store_hits_are_split_by_default_only_where_the_split_is_exact():
    """Outside the deterministic mode a head recomputed in a forward of another length is not
    the stored pages' bytes (library matmuls round a row by the forward's row count), so a
    store hit is loaded whole unless the user asks for the planner's split."""
    from kvtier.engine.prefix import split_for

    assert split_for(make_config(engine__deterministic="false")) == "load"
    assert split_for(make_config(engine__device="cpu")) == "load"     # auto: off on the CPU
    assert split_for(make_config(engine__deterministic="true")) == "plan"
    assert split_for(make_config(engine__store_hit_split="plan",
                                 engine__deterministic="false")) == "plan"
    assert split_for(make_config(engine__deterministic="true",
                                 engine__store_hit_split="load")) == "load"
