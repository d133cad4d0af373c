"""Correctness matrix: the same greedy tokens and last-position logits (fp32, within 1e-5) whether
the prompt is computed cold or its prefix comes from the device, host, disk or Redis tier, after a
restart, or through the hybrid load + recompute split; on Llama and Qwen2, at two page sizes."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from kvtier.engine.prefix import PrefixCache
from kvtier.engine.request import PrefillReport
from redis_server import REDIS_SERVER, running_server
from test_engine_support import make_config, tiny_lm

NEW_TOKENS = 6
TOLERANCE = 1e-5


@dataclass
class Answer:
    tokens: list[int]
    logits: torch.Tensor
    report: PrefillReport | None


def reference(lm, prompt: list[int]) -> Answer:
    cache = lm.new_cache()
    logits = lm.forward(torch.tensor(prompt), cache)
    return Answer(_greedy(lm, cache, logits), logits, None)


def _greedy(lm, cache, logits) -> list[int]:
    out = [int(torch.argmax(logits))]
    while len(out) < NEW_TOKENS:
        logits = lm.forward(torch.tensor(out[-1:]), cache)
        out.append(int(torch.argmax(logits)))
    return out


def through(cache: PrefixCache, prompt: list[int], salt: str | None = None) -> Answer:
    report = PrefillReport(len(prompt))
    kv, logits, state = cache.prefill(prompt, salt, report)
    cache.commit_prompt(state, prompt, kv)
    tokens = _greedy(cache.lm, kv, logits)
    cache.finish(state, prompt + tokens[:-1], kv)
    cache.settle()
    cache.tiered.check_integrity()
    return Answer(tokens, logits, report)


def build(lm, page_size: int, tmp_path, *, disk: bool = False, redis_url: str = "") -> PrefixCache:
    config = make_config(cache__page_size=page_size, controller__min_prefetch_tokens=0,
                         controller__prefetch_policy="wait_complete",
                         store__disk_url=f"file://{tmp_path}/disk" if disk else "",
                         store__remote_url=redis_url,
                         engine__store_hit_split="plan")   # the hybrid split is checked too
    return PrefixCache.build(config, lm)


def check(name: str, want: Answer, got: Answer, tier: str | None, tokens: int) -> None:
    assert got.tokens == want.tokens, f"{name}: greedy tokens differ"
    gap = float((got.logits - want.logits).abs().max())
    assert gap <= TOLERANCE, f"{name}: last logits differ by {gap}"
    report = got.report
    assert report is not None
    if tier is None:
        assert report.cached_tokens == 0, f"{name}: expected a miss, got {report.as_dict()}"
    else:
        assert report.cached_by_tier[tier] == tokens, f"{name}: {report.as_dict()}"
        assert report.cached_tokens == tokens, f"{name}: {report.as_dict()}"


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (bash scripts/install_system_deps.sh)")
    with running_server(tmp_path_factory.mktemp("redis")) as server:
        yield server.url()


@pytest.mark.parametrize("page_size", [8, 32])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_every_tier_gives_the_tokens_and_logits_of_a_cold_run(model, page_size, tmp_path,
                                                               redis_url):
    lm = tiny_lm(model)
    rng = random.Random(f"{model}-{page_size}")
    prompt = [rng.randrange(10, 1000) for _ in range(5 * page_size + 7)]
    hit = 5 * page_size
    want = reference(lm, prompt)

    both = build(lm, page_size, tmp_path, disk=True, redis_url=redis_url)
    try:
        check("cold", want, through(both, prompt), None, 0)
        check("device hit", want, through(both, prompt), "device", hit)
        both.drop_tiers(("device",))
        check("host-only hit", want, through(both, prompt), "host", hit)
        both.drop_tiers(("device", "host"))
        check("disk-only hit", want, through(both, prompt), "disk", hit)
    finally:
        both.close()

    restarted = build(lm, page_size, tmp_path, disk=True)
    try:
        check("disk hit after restart", want, through(restarted, prompt), "disk", hit)
        restarted.drop_tiers(("device", "host"))
        rates = restarted.tiered.controller.rates
        rates.rates["disk"] = (lm.kv_layout(page_size).bytes_per_token * 5000.0, 0.0)
        rates.prefill_tokens_per_s = 5000.0  # loading as slow as recomputing: split in half
        hybrid = through(restarted, prompt)
        assert 0 < hybrid.report.recomputed_hit_tokens < hit, hybrid.report.as_dict()
        check("hybrid split", want, hybrid, "disk", hit - hybrid.report.recomputed_hit_tokens)
    finally:
        restarted.close()

    remote_only = build(lm, page_size, tmp_path, redis_url=redis_url)
    try:
        check("redis-only hit (fresh process state)", want, through(remote_only, prompt),
              "remote", hit)
    finally:
        remote_only.close()
