"""Continuous batching through the service: same greedy output alone or in any batch (fp32),
chunked prefills beside decodes, preemption when the device pool runs out, hits read in place."""

from __future__ import annotations

import random
import time

import torch

from kvtier.engine.request import GenerationRequest
from kvtier.engine.service import EngineService
from test_engine_support import make_config, tiny_lm


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def _greedy(lm, prompt: list[int], new: int) -> list[int]:
    """Plain transformers: the whole sequence recomputed for every token."""
    tokens = list(prompt)
    for _ in range(new):
        logits = lm.forward(torch.tensor(tokens), lm.new_cache())
        tokens.append(int(torch.argmax(logits)))
    return tokens[len(prompt):]


def _run(service: EngineService, prompts: list[list[int]], new: int) -> list[list[int]]:
    handles = [service.submit(GenerationRequest(tuple(p), new)) for p in prompts]
    results = [h.result(timeout=300) for h in handles]
    for _, finish in results:
        assert finish.reason == "length", finish
    return [tokens for tokens, _ in results]


def _service(max_running: int, **flags) -> EngineService:
    return EngineService.build(make_config(**flags), lm=tiny_lm(), max_running=max_running)


PROMPTS = [_prompt(n, i) for i, n in enumerate((37, 5, 80, 16, 61, 23))]


def test_greedy_output_is_the_same_alone_or_in_any_batch():
    alone = _service(1, **{"engine.prefill_chunk_tokens": 1000, "cache.enabled": "false"})
    try:
        want = [_run(alone, [p], 12)[0] for p in PROMPTS]
    finally:
        alone.close()
    assert want[2] == _greedy(tiny_lm(), PROMPTS[2], 12)
    for chunk, cache in ((16, "false"), (7, "true"), (1000, "true")):
        batched = _service(6, **{"engine.prefill_chunk_tokens": chunk, "cache.enabled": cache})
        try:
            got = _run(batched, PROMPTS, 12)
            steps = batched.engine.counters["steps"]
        finally:
            batched.close()
        assert got == want, f"chunk {chunk}, cache {cache}"
        assert steps < 6 * 12, "the sequences did not share forwards"


def test_a_long_prompt_runs_in_chunks_beside_the_decodes():
    service = _service(2, **{"engine.prefill_chunk_tokens": 8, "cache.enabled": "false"})
    try:
        short = service.submit(GenerationRequest(tuple(PROMPTS[1]), 30))
        long = service.submit(GenerationRequest(tuple(PROMPTS[2]), 2))
        got = [h.result(timeout=300)[0] for h in (short, long)]
        stats = service.engine.counters
    finally:
        service.close()
    assert got[1] == _greedy(tiny_lm(), PROMPTS[2], 2)
    assert stats["steps"] <= 30 + 2, "the chunks did not share steps with the decode"
    assert stats["batched_tokens"] == 5 + 30 - 1 + 80 + 2 - 1


def test_a_full_device_pool_preempts_and_every_sequence_still_matches():
    prompts = [_prompt(40, 50 + i) for i in range(4)]
    want = [_greedy(tiny_lm(), p, 30) for p in prompts]
    for cache in ("true", "false"):   # resumed from the cache, or recomputed
        service = _service(4, **{"cache.device_pages": 12, "cache.enabled": cache})
        try:
            got = _run(service, prompts, 30)
            preempted = service.engine.counters["preempted"]
            if service.prefix_cache is not None:
                service.prefix_cache.tiered.check_integrity()
        finally:
            service.close()
        assert got == want, f"cache {cache}"
        assert preempted > 0


def test_a_sequence_the_pool_cannot_hold_fails_and_the_engine_keeps_serving():
    service = _service(2, **{"cache.device_pages": 4, "cache.enabled": "false"})
    try:
        big = service.submit(GenerationRequest(tuple(_prompt(70, 1)), 4))
        _, finish = big.result(timeout=60)
        small = service.generate(GenerationRequest(tuple(_prompt(10, 2)), 3), timeout=60)
    finally:
        service.close()
    assert finish.reason == "error" and finish.error_kind == "PoolExhausted"
    assert small[1].reason == "length" and len(small[0]) == 3


def test_a_device_hit_is_read_in_place_while_the_first_sequence_decodes():
    shared = _prompt(48, 9)
    service = _service(2)
    try:
        first = service.submit(GenerationRequest(tuple(shared + [5, 6]), 60))
        while first.first_token_at is None:
            time.sleep(0.001)
        second = service.generate(GenerationRequest(tuple(shared + [7]), 3), timeout=60)
        first_running = not first.done.is_set()
        first.result(timeout=60)
        service.prefix_cache.tiered.check_integrity()
    finally:
        service.close()
    assert first_running
    assert second[1].prefill.cached_tokens == 48
    assert second[1].prefill.cached_by_tier["device"] == 48
    assert second[0] == _greedy(tiny_lm(), shared + [7], 3)


def test_hits_from_every_tier_and_every_split_give_the_cold_tokens(tmp_path):
    prefix, tail = _prompt(64, 30), _prompt(9, 31)
    want = _greedy(tiny_lm(), prefix + tail, 5)
    config = make_config(controller__min_prefetch_tokens=0,
                         controller__prefetch_policy="wait_complete",
                         store__disk_url=f"file://{tmp_path}/disk")
    service = EngineService.build(config, lm=tiny_lm(), max_running=2)
    cache = service.prefix_cache

    def on_engine(fn):
        return service.scheduler.call_soon(fn).result(timeout=60)

    try:
        assert _run(service, [prefix + [3]], 2)
        on_engine(cache.settle)
        cases = [("device", (), "plan"), ("host", ("device",), "plan"),
                 ("disk", ("device", "host"), "load"), ("disk", ("device", "host"), "recompute"),
                 ("disk", ("device", "host"), "plan"), ("disk", ("device", "host"), "half")]
        plan_head = cache.head_tokens
        for tier, dropped, split in cases:
            def prepare(dropped=dropped, split=split):
                # "half": the head's two pages recomputed while the tail's two load
                cache.head_tokens = (lambda hit: 32) if split == "half" else plan_head
                cache.split = "plan" if split == "half" else split
                if dropped:
                    cache.drop_tiers(dropped)
            on_engine(prepare)
            got, finish = service.generate(GenerationRequest(tuple(prefix + tail), 5), timeout=120)
            assert got == want, (tier, split)
            report = finish.prefill
            loaded = report.cached_by_tier[tier]
            assert loaded + report.recomputed_hit_tokens == 64, (tier, split, report.as_dict())
            assert (loaded == 0) == (split == "recompute"), (tier, split, report.as_dict())
            if split == "half":
                assert loaded == 32 and report.recomputed_hit_tokens == 32, report.as_dict()
            on_engine(cache.settle)
            on_engine(cache.tiered.check_integrity)
    finally:
        service.close()


def test_a_lone_fresh_hit_runs_its_suffix_through_the_static_forward():
    """The captured suffix forwards (run eagerly on the CPU) serve a hit on an idle engine; the
    KV they compute lands in the sequence's pages, so the batched decode after them matches."""
    from kvtier.engine.prefix import PrefixCache
    from kvtier.engine.suffix_step import SuffixStep

    lm, config = tiny_lm(), make_config()
    prefix_cache = PrefixCache.build(config, lm, graphs=False)
    service = EngineService(config, lm, prefix_cache, max_running=2)
    service.engine.suffix = SuffixStep(lm, 512, service.engine.pages.scratch_page,
                                       capture=False, backend="torch")
    shared = _prompt(48, 40)
    try:
        _run(service, [shared + [1, 2]], 2)
        got = [_run(service, [shared + _prompt(9, 41 + i)], 6)[0] for i in range(2)]
        served = service.engine.stats()["suffix_graph_steps"]
        service.scheduler.call_soon(lambda: prefix_cache.drop_tiers(("device",))).result(60)
        host = service.generate(GenerationRequest(tuple(shared + [3] * 9), 6), timeout=60)
        served_host = service.engine.stats()["suffix_graph_steps"]
        # a prompt cached whole: its last token runs alone, after a past of no whole pages
        whole = [service.generate(GenerationRequest(tuple(shared), 6), timeout=60)
                 for _ in range(2)]
        served_whole = service.engine.stats()["suffix_graph_steps"]
    finally:
        service.close()
    assert got == [_greedy(lm, shared + _prompt(9, 41 + i), 6) for i in range(2)]
    assert served == 2
    assert host[0] == _greedy(lm, shared + [3] * 9, 6)
    assert host[1].prefill.cached_by_tier["host"] == 48 and served_host == 3
    assert [w[0] for w in whole] == [_greedy(lm, shared, 6)] * 2
    assert whole[1][1].prefill.cached_tokens == 47 and served_whole == 5


def test_a_seeded_sampled_request_draws_the_same_tokens_alone_or_in_a_batch():
    from kvtier.engine.sampling import SamplingParams

    sampled = GenerationRequest(tuple(PROMPTS[0]), 10,
                                SamplingParams(temperature=0.9, top_p=0.95, seed=7))
    outputs = []
    for max_running, others in ((1, []), (4, PROMPTS[1:4])):
        service = _service(max_running, **{"cache.enabled": "false"})
        try:
            handles = [service.submit(sampled)]
            handles += [service.submit(GenerationRequest(tuple(p), 10)) for p in others]
            outputs.append(handles[0].result(timeout=120)[0])
            for handle in handles[1:]:
                handle.result(timeout=120)
        finally:
            service.close()
    assert outputs[0] == outputs[1] and len(outputs[0]) == 10
    assert outputs[0] != _greedy(tiny_lm(), PROMPTS[0], 10)   # it did sample


class _PendingCopy:
    """A host copy that lands when the test says so (the paged forward only waits on it)."""

    def __init__(self) -> None:
        self.landed = False

    def is_done(self) -> bool:
        return self.landed

    alone = False

    def stream_wait(self, stream=None, layer=None) -> None:
        assert self.landed or self.alone, "a step ran a row whose copy had not landed"


def test_a_hit_still_loading_waits_out_of_the_steps_while_others_decode():
    from kvtier.engine.request import RequestHandle
    from kvtier.engine.runner import Engine
    from kvtier.engine.seq_pages import PlainPages
    from kvtier.memory.device_pool import DevicePool

    lm, config = tiny_lm(), make_config()
    pool = DevicePool.from_config(config.cache, lm.kv_layout(16), "cpu")
    engine = Engine(lm, PlainPages(pool), chunk_tokens=4096)

    decoding = engine.admit(RequestHandle(GenerationRequest(tuple(_prompt(40, 1)), 50)))
    engine.step([decoding])                      # its prompt: it decodes from now on
    loading = engine.admit(RequestHandle(GenerationRequest(tuple(_prompt(30, 2)), 5)))
    copy = loading.kv.ticket = _PendingCopy()
    for _ in range(3):
        engine.step([decoding, loading])
    assert loading.computed == 0 and decoding.generated == 4
    assert engine.counters["deferred_for_load"] == 3
    copy.landed = True
    engine.step([decoding, loading])
    assert loading.computed == 30 and loading.generated == 1 and decoding.generated == 5
    alone = engine.admit(RequestHandle(GenerationRequest(tuple(_prompt(20, 3)), 5)))
    alone.kv.ticket = _PendingCopy()
    alone.kv.ticket.alone = True
    engine.step([alone])                         # nothing else to run: it steps at once
    assert alone.generated == 1 and engine.counters["deferred_for_load"] == 3


def test_closing_the_service_gives_its_device_pool_back_while_it_is_still_referenced():
    import weakref

    for cache in ("true", "false"):
        service = _service(2, cache__enabled=cache)
        _run(service, [_prompt(40, 3)], 2)
        pool = weakref.ref(service.engine.pages.kv)
        service.close()
        assert pool() is None, f"cache.enabled={cache}: the closed service still holds its pool"
        assert service.engine.pages.kv.numel() == 0
