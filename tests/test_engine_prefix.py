"""The engine's use of the tiered cache beyond the tier matrix: whole-prompt hits, tenant salts,
pages added by generation, device-pool pressure, split modes and the scheduler on top."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier.engine.prefix import PrefixCache, _attribute
from kvtier.engine.request import GenerationRequest
from kvtier.engine.service import EngineService
from test_engine_cache_matrix import build, reference, through
from test_engine_support import make_config, tiny_lm


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


@pytest.fixture
def cache(tmp_path):
    prefix_cache = build(tiny_lm(), 16, tmp_path)
    yield prefix_cache
    prefix_cache.close()


def test_a_prompt_cached_whole_still_runs_its_last_token(cache):
    prompt = _prompt(64, 1)  # exactly four pages
    want = reference(cache.lm, prompt)
    through(cache, prompt)
    again = through(cache, prompt)
    assert again.tokens == want.tokens
    assert float((again.logits - want.logits).abs().max()) <= 1e-5
    assert again.report.cached_tokens == 63 and again.report.computed_tokens == 1


def test_tenant_salt_keeps_prefixes_apart(cache):
    prompt = _prompt(50, 2)
    through(cache, prompt, salt="a")
    assert through(cache, prompt, salt="b").report.cached_tokens == 0
    assert through(cache, prompt, salt="a").report.cached_tokens == 48
    assert through(cache, prompt).report.cached_tokens == 0


def test_generated_tokens_are_cached_for_the_next_turn(cache):
    prompt = _prompt(44, 3)
    first = through(cache, prompt)  # 44 + 5 fed tokens: three full pages, the prompt had two
    follow_up = prompt + first.tokens + _prompt(20, 4)
    report = through(cache, follow_up).report
    assert report.cached_tokens == 32 + 16  # the prompt's pages and the page generation filled


def test_a_small_device_pool_evicts_and_stays_correct(tmp_path):
    config = make_config(cache__device_pages=6, cache__page_size=16)
    cache = PrefixCache.build(config, tiny_lm())
    try:
        prompts = [_prompt(50, 10 + i) for i in range(5)]
        wants = [reference(cache.lm, p) for p in prompts]
        for _ in range(2):
            for prompt, want in zip(prompts, wants, strict=True):
                assert through(cache, prompt).tokens == want.tokens
        stats = cache.stats()["tiers"]
        assert stats["device"]["pages"] <= 6 and stats["host"]["pages"] > 6
    finally:
        cache.close()


def test_split_modes_recompute_or_load_the_whole_hit(cache):
    prompt = _prompt(70, 5)
    want = reference(cache.lm, prompt)
    through(cache, prompt)
    cache.drop_tiers(("device",))
    cache.split = "recompute"
    recomputed = through(cache, prompt)
    assert recomputed.tokens == want.tokens
    assert recomputed.report.recomputed_hit_tokens == 64 and recomputed.report.cached_tokens == 0
    cache.drop_tiers(("device",))
    cache.split = "load"
    loaded = through(cache, prompt)
    assert loaded.report.cached_by_tier["host"] == 64 and loaded.tokens == want.tokens
    with pytest.raises(ValueError):
        cache.split = "sometimes"


def test_a_hit_held_in_ram_is_loaded_whole_whatever_the_rates(cache):
    prompt = _prompt(70, 8)
    through(cache, prompt)
    cache.drop_tiers(("device",))
    rates = cache.tiered.controller.rates
    rates.rates["host"] = (cache.lm.kv_layout(16).bytes_per_token * 100.0, 0.0)
    rates.prefill_tokens_per_s = 1e6  # recomputing would look far cheaper
    report = through(cache, prompt).report
    assert report.recomputed_hit_tokens == 0 and report.cached_by_tier["host"] == 64


def test_cold_prefills_teach_the_planner_the_prefill_rate(cache):
    assert cache.stats()["rates"]["prefill_tokens_per_s"] is None
    through(cache, _prompt(40, 6))  # too short to say anything about the rate
    assert cache.stats()["rates"]["prefill_tokens_per_s"] is None
    through(cache, _prompt(300, 9))
    assert cache.stats()["rates"]["prefill_tokens_per_s"] > 0


def test_attribution_follows_the_tiers_in_prefix_order():
    by_tier = {"device": 32, "host": 32, "disk": 64, "remote": 0}
    assert _attribute(by_tier, 0, 128) == {"device": 32, "host": 32, "disk": 64, "remote": 0}
    assert _attribute(by_tier, 48, 50) == {"device": 0, "host": 16, "disk": 34, "remote": 0}


def test_engine_thread_serves_interleaved_requests_sharing_a_prefix():
    lm = tiny_lm("tiny-qwen2")
    shared = _prompt(48, 7)
    prompts = [shared + _prompt(5 + i, 20 + i) for i in range(6)]
    wants = [reference(lm, p).tokens for p in prompts]
    service = EngineService.build(make_config(), lm=lm, max_running=3)
    try:
        handles = [service.submit(GenerationRequest(tuple(p), 6)) for p in prompts]
        results = [h.result(timeout=120) for h in handles]
        again = service.generate(GenerationRequest(tuple(prompts[0]), 6), timeout=120)
        service.prefix_cache.tiered.check_integrity()
    finally:
        service.close()
    assert [tokens for tokens, _ in results] == wants
    assert again[0] == wants[0] and again[1].prefill.cached_tokens == 48
    assert all(isinstance(t, int) for t in torch.tensor(wants[0]).tolist())


def test_a_split_starts_the_store_reads_before_the_head_forward(tmp_path):
    lm = tiny_lm()
    cache = build(lm, 16, tmp_path, disk=True)
    prompt = _prompt(16 * 8 + 3, 21)
    want = reference(lm, prompt)
    try:
        through(cache, prompt)
        cache.drop_tiers(("device", "host"))
        rates = cache.tiered.controller.rates
        rates.rates["disk"] = (lm.kv_layout(16).bytes_per_token * 5000.0, 0.0)
        rates.prefill_tokens_per_s = 5000.0  # loading as slow as recomputing: split in half
        order: list[str] = []
        prefetch, forward = cache.tiered.prefetch, lm.forward

        def early(hit, **kwargs):
            order.append("prefetch")
            return prefetch(hit, **kwargs)

        def run(tokens, kv, **kwargs):
            order.append(f"forward {tokens.shape[0]}")
            return forward(tokens, kv, **kwargs)

        cache.tiered.prefetch, lm.forward = early, run
        submitted = []
        workers = cache.tiered.ctx.workers
        submit = workers.submit
        workers.submit = lambda job: submitted.append(job) or submit(job)
        got = through(cache, prompt)
        head = got.report.recomputed_hit_tokens
        assert 0 < head < 128
        assert order[:2] == ["prefetch", f"forward {head}"]
        assert got.tokens == want.tokens
        assert len(submitted) == 1  # the load used the early reads, it did not start again
    finally:
        del lm.forward
        cache.close()
