"""The direct path (``"direct": true``) under vLLM's real ``Scheduler``: a prompt is written from
vLLM's blocks straight into host pages in the step its prefill completes, the next request
with that prompt is claimed from the host tier and its blocks receive the saved rows, a
finished request's output pages follow in the next step with its blocks held, and no staging
page is used. The worker half runs by hand over CPU tensors in vLLM's CPU layout
(``save_harness``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from save_harness import BLOCK, make_worker, prompt_ids
from scheduler_harness import (
    make_kv_cache_config,
    make_request,
    make_scheduler,
    make_vllm_config,
    runner_output,
)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def scheduler(tiny_model: Path, tmp_path: Path):
    config = make_vllm_config(tiny_model, {"host_pool_bytes": "8MiB", "direct": True,
                                           "disk_url": f"file://{tmp_path / 'disk'}"},
                              block_size=BLOCK, max_batched=256)
    sched = make_scheduler(config, make_kv_cache_config(BLOCK))
    yield sched
    sched.connector.runtime.close()


def _run_to_end(scheduler, worker, request) -> None:
    from vllm.v1.request import RequestStatus

    while not RequestStatus.is_finished(request.status):
        out = scheduler.schedule()
        meta = out.kv_connector_metadata
        worker.start_load_kv(meta)
        for name in worker.kv_caches:
            worker.wait_for_layer_load(name)
        worker.wait_for_save(meta)
        scheduler.update_from_output(out, runner_output(
            out, finished_sending=worker.get_finished(out.finished_req_ids)))


def test_a_prompt_saved_to_host_is_claimed_and_loaded_into_the_next_requests_blocks(scheduler):
    runtime = scheduler.connector.runtime
    assert runtime.direct and runtime.saves_in_step
    worker = make_worker(runtime, copy_in_step=True)
    assert worker.direct is not None and worker.blocks is None     # vLLM's CPU layout
    tokens = prompt_ids(100, 30)
    first = make_request(tokens, BLOCK, max_tokens=1)
    scheduler.add_request(first)
    out = scheduler.schedule()
    blocks = list(out.scheduled_new_reqs[0].block_ids[0])
    worker.wait_for_save(out.kv_connector_metadata)
    scheduler.update_from_output(out, runner_output(out))
    assert runtime.counts["saved_tokens"] == 96
    with runtime.lock:
        hit = runtime.cache.match(tokens)
    assert hit.tokens_by_tier["host"] == 96 and hit.tokens_by_tier["device"] == 0
    layout, kv = worker.layout, worker.kv_caches
    old_slots = torch.tensor([blocks[t // BLOCK] * BLOCK + t % BLOCK for t in range(96)])
    want = {name: layout.read(t, old_slots) for name, t in kv.items()}
    for t in kv.values():             # the next request's blocks hold other rows meanwhile
        t.normal_()
    assert scheduler.reset_prefix_cache()      # so the hit can only come from kvtier

    second = make_request(tokens, BLOCK, max_tokens=1)
    scheduler.add_request(second)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens[second.request_id] == 100 - 96
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 96
    meta = out.kv_connector_metadata
    worker.start_load_kv(meta)
    for name in kv:
        worker.wait_for_layer_load(name)
    worker.wait_for_save(meta)
    new_slots = torch.tensor([new.block_ids[0][t // BLOCK] * BLOCK + t % BLOCK
                              for t in range(96)])
    for name, t in kv.items():
        for got, expected in zip(layout.read(t, new_slots), want[name], strict=True):
            assert torch.equal(got, expected), name
    assert runtime.counts["hit_tokens_host"] == 96 and runtime.counts["load_errors"] == 0
    assert runtime.counts["saves_skipped_held"] == 0       # the hit's prompt: held, not saved
    stats = runtime.cache.stats()["counters"]
    assert stats.get("load_back_pages_total", 0) == 0 and stats.get("commit_total", 0) == 0
    scheduler.update_from_output(out, runner_output(out))
    assert not runtime.staged
    runtime.cache.check_integrity()


def test_a_finished_requests_output_pages_go_to_host_with_its_blocks_held(scheduler):
    runtime = scheduler.connector.runtime
    worker = make_worker(runtime, copy_in_step=True)
    request = make_request(prompt_ids(40, 700), BLOCK, max_tokens=30)   # 1 prompt page, 2 in all
    scheduler.add_request(request)
    _run_to_end(scheduler, worker, request)
    assert request.request_id in scheduler.requests          # kept for the finish-time save
    step = scheduler.schedule()
    assert step.kv_connector_metadata.held == [request.request_id]
    worker.wait_for_save(step.kv_connector_metadata)
    assert worker.get_finished(step.finished_req_ids) == {request.request_id}
    with runtime.lock:
        hit = runtime.cache.match(list(request.all_token_ids)[:64])
    assert hit.tokens_by_tier["host"] == 64
    assert runtime.counts["saved_tokens"] == 32 + 32
    runtime.cache.check_integrity()
