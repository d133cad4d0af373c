"""Hits only a store holds, under vLLM's real ``Scheduler`` (no model runs): a disk part lands
in the host tier off the scheduling thread while other requests run, is read at once when
nothing else does, and is left to vLLM when it was measured slower to read than vLLM computes
it; busy steps teach the connector vLLM's prefill rate (``integrations.vllm.pricing``).
"""

from __future__ import annotations

import time

import pytest
from scheduler_harness import (
    BLOCK,
    admit,
    fill_kvtier,
    make_kv_cache_config,
    make_request,
    make_scheduler,
    make_vllm_config,
    ramp,
    runner_output,
)

from kvtier.integrations.vllm.scheduler import TIER_SOURCES

pytestmark = pytest.mark.timeout(600)


def _disk_only(runtime, tokens: list[int]) -> None:
    fill_kvtier(runtime, tokens)                   # committed, then written to the disk tier
    with runtime.lock:
        runtime.cache.clear_tier("device")
        runtime.cache.clear_tier("host")


def test_a_hit_only_the_disk_holds_lands_while_other_requests_are_scheduled(scheduler):
    """While another request runs, the scheduling thread does not read the disk: the first
    answer is "ask again" (the prefetch to the host tier runs on kvtier's IO threads) and the
    request waits while the other one steps; once the pages landed, the whole hit is claimed."""
    runtime = scheduler.connector.runtime
    tokens = ramp(300)
    _disk_only(runtime, tokens)
    other, out = admit(scheduler, ramp(40, start=500))   # no hit: it runs
    scheduler.update_from_output(out, runner_output(out))
    held = make_request(tokens, BLOCK)
    scheduler.add_request(held)
    out = scheduler.schedule()
    assert out.scheduled_new_reqs == []            # asked again later; no disk read here
    assert other.request_id in out.num_scheduled_tokens
    assert runtime.counts["lookups_deferred_landing"] == 1
    for _ in range(200):                           # a step every 10 ms until the hit is staged
        scheduler.update_from_output(out, runner_output(out))
        if any(r.req_id == held.request_id for r in out.scheduled_new_reqs):
            break
        time.sleep(0.01)
        out = scheduler.schedule()
    (new,) = [r for r in out.scheduled_new_reqs if r.req_id == held.request_id]
    assert new.num_computed_tokens == 288          # nine full 32-token pages, from the disk
    (load,) = [spec for spec in out.kv_connector_metadata.loads
               if spec.req_id == held.request_id]
    assert (load.start, load.end) == (0, 288)
    assert scheduler.connector.get_external_cache_hit_sources(held, 288) == {
        TIER_SOURCES["disk"]: 288}
    assert runtime.counts["lookups"] == 2          # one walk of the index per request
    assert runtime.counts["lookups_deferred_landing"] == 1


def test_with_nothing_else_running_a_disk_hit_is_read_at_once(scheduler):
    runtime = scheduler.connector.runtime
    tokens = ramp(300)
    _disk_only(runtime, tokens)
    _, out = admit(scheduler, tokens)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 288
    assert runtime.counts.get("lookups_deferred_landing", 0) == 0


@pytest.mark.parametrize("prefill_tokens_per_s,claimed", [(1e6, 0), (1.0, 288)])
def test_a_disk_part_measured_slower_than_vllms_prefill_is_left_to_vllm(
        scheduler, prefill_tokens_per_s, claimed):
    """Reading the disk's part (1 MB/s, measured) against vLLM computing it: a million tokens
    a second, and the request is not made to wait for the disk (the tokens are computed,
    counted); one token a second, and the hit is claimed whole."""
    runtime = scheduler.connector.runtime
    rates = runtime.cache.controller.rates
    rates.observed["disk"] = 1                     # a read was seen: the rate is measured
    rates.rates["disk"] = (1e6, 0.0)
    clock = scheduler.connector.scheduler._clock   # as if busy steps had taught it the rate
    clock._tokens, clock._seconds = prefill_tokens_per_s, 1.0
    tokens = ramp(300)
    _disk_only(runtime, tokens)
    _, out = admit(scheduler, tokens)
    assert out.scheduled_new_reqs[0].num_computed_tokens == claimed
    assert runtime.counts["store_tokens_declined_slower"] == 288 - claimed
    assert len(out.kv_connector_metadata.loads) == (1 if claimed else 0)


def test_busy_steps_teach_the_connector_vllms_prefill_rate(tiny_model, tmp_path):
    """A 1,200-token prompt in steps of at most 512: the second step is timed (the first of a
    run is not; the request runs on in the third), its tokens over its time the rate."""
    config = make_vllm_config(tiny_model, {"host_pool_bytes": "8MiB", "staging_pages": 64},
                              block_size=BLOCK, max_batched=512)
    sched = make_scheduler(config, make_kv_cache_config(BLOCK))
    try:
        clock = sched.connector.scheduler._clock
        _, out = admit(sched, ramp(1200, start=300))
        for _ in range(2):
            assert out.total_num_scheduled_tokens == 512
            assert clock.tokens_per_s is None
            time.sleep(0.05)                       # the step's forward, as the clock sees it
            sched.update_from_output(out, runner_output(out))
            out = sched.schedule()
        assert 0 < out.total_num_scheduled_tokens < 512   # the same request, run on
        assert 512 / 30 < clock.tokens_per_s <= 512 / 0.05
    finally:
        sched.connector.runtime.close()
