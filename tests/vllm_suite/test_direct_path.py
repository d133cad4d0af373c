"""The direct path (``"direct": true``) under vLLM's real ``Scheduler``: a prompt is written from
vLLM's blocks straight into host pages in the step its prefill completes; the next request
with that prompt is claimed from the host tier as an asynchronous load (it waits in
``WAITING_FOR_REMOTE_KVS`` while the worker copies, and runs once reported received), and its
blocks receive the saved rows; a finished request's blocks are kept until its saves are over
and freed exactly once; a request aborted while it loads gives its blocks back; no staging page
is used. The worker half runs by hand over CPU tensors in vLLM's CPU layout (``save_harness``),
as the model runner calls it (``step``)."""

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


def step(scheduler, worker, out=None):
    """One step as vLLM's model runner drives the connector's worker half: loads started
    before the forward, saves after it, then what finished (sent and received)."""
    out = scheduler.schedule() if out is None else out
    meta = out.kv_connector_metadata
    worker.handle_preemptions(meta)
    worker.start_load_kv(meta)
    for name in worker.kv_caches:
        worker.wait_for_layer_load(name)
    worker.wait_for_save(meta)
    scheduler.update_from_output(out, runner_output(
        out, finished_sending=worker.get_finished(out.finished_req_ids),
        finished_recving=worker.take_received()))
    return out


def _run_to_end(scheduler, worker, request) -> None:
    from vllm.v1.request import RequestStatus

    for _ in range(200):
        if RequestStatus.is_finished(request.status):
            return
        step(scheduler, worker)
    raise AssertionError(f"{request.request_id} did not finish: {request.status}")


def _free_blocks(scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def test_a_prompt_saved_to_host_is_loaded_asynchronously_into_the_next_requests_blocks(
        scheduler):
    from vllm.v1.request import RequestStatus

    runtime = scheduler.connector.runtime
    assert runtime.direct and runtime.saves_in_step
    worker = make_worker(runtime, copy_in_step=True)
    assert worker.direct is not None and worker.blocks is None     # vLLM's CPU layout
    tokens = prompt_ids(100, 30)
    first = make_request(tokens, BLOCK, max_tokens=1)
    scheduler.add_request(first)
    out = scheduler.schedule()
    blocks = list(out.scheduled_new_reqs[0].block_ids[0])
    step(scheduler, worker, out)
    assert runtime.counts["saved_tokens"] == 96
    with runtime.lock:
        hit = runtime.cache.match(tokens)
    assert hit.tokens_by_tier["host"] == 96 and hit.tokens_by_tier["device"] == 0
    layout, kv = worker.layout, worker.kv_caches
    old_slots = torch.tensor([blocks[t // BLOCK] * BLOCK + t % BLOCK for t in range(96)])
    want = {name: layout.read(t, old_slots) for name, t in kv.items()}
    step(scheduler, worker)                    # the first request's blocks come back
    assert first.request_id not in scheduler.requests
    for t in kv.values():             # the next request's blocks hold other rows meanwhile
        t.normal_()
    assert scheduler.reset_prefix_cache()      # so the hit can only come from kvtier

    second = make_request(tokens, BLOCK, max_tokens=1)
    scheduler.add_request(second)
    out = step(scheduler, worker)              # the load: the request does not run yet
    assert second.request_id not in out.num_scheduled_tokens
    assert out.kv_connector_metadata.loads[0].req_id == second.request_id
    assert runtime.counts["loads_async"] == 1
    assert second.status == RequestStatus.WAITING or second.request_id in \
        scheduler.finished_recving_kv_req_ids
    out = scheduler.schedule()                 # received: it runs from token 96
    assert out.num_scheduled_tokens[second.request_id] == 100 - 96
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 96
    step(scheduler, worker, out)
    new_slots = torch.tensor([new.block_ids[0][t // BLOCK] * BLOCK + t % BLOCK
                              for t in range(96)])
    for name, t in kv.items():
        for got, expected in zip(layout.read(t, new_slots), want[name], strict=True):
            assert torch.equal(got, expected), name
    assert runtime.counts["hit_tokens_host"] == 96 and runtime.counts["load_errors"] == 0
    assert runtime.counts["saves_skipped_held"] == 0       # the hit's prompt: held, not saved
    stats = runtime.cache.stats()["counters"]
    assert stats.get("load_back_pages_total", 0) == 0 and stats.get("commit_total", 0) == 0
    assert not runtime.staged and not worker.steps._receiving
    runtime.cache.check_integrity()


def test_a_finished_requests_blocks_are_kept_until_its_saves_are_over(scheduler):
    runtime = scheduler.connector.runtime
    worker = make_worker(runtime, copy_in_step=True)
    free = _free_blocks(scheduler)
    request = make_request(prompt_ids(40, 700), BLOCK, max_tokens=30)   # 1 prompt page, 2 in all
    scheduler.add_request(request)
    _run_to_end(scheduler, worker, request)
    assert request.request_id in scheduler.requests          # kept for the finish-time save
    out = scheduler.schedule()
    assert out.kv_connector_metadata.held == [request.request_id]
    step(scheduler, worker, out)
    assert request.request_id not in scheduler.requests       # freed once, no error
    with runtime.lock:
        hit = runtime.cache.match(list(request.all_token_ids)[:64])
    assert hit.tokens_by_tier["host"] == 64
    assert runtime.counts["saved_tokens"] == 32 + 32
    step(scheduler, worker)
    assert _free_blocks(scheduler) == free
    assert not worker.steps._saving and not worker.steps._releasing
    runtime.cache.check_integrity()


def test_a_request_whose_prompt_was_saved_keeps_its_blocks_until_the_save_is_reported(
        scheduler):
    runtime = scheduler.connector.runtime
    worker = make_worker(runtime, copy_in_step=True)
    free = _free_blocks(scheduler)
    request = make_request(prompt_ids(70, 300), BLOCK, max_tokens=1)    # no output page
    scheduler.add_request(request)
    step(scheduler, worker)                    # prefill, the prompt's save; it finishes
    assert runtime.counts["saved_tokens"] == 64
    assert request.request_id in scheduler.requests          # its save may still read them
    out = step(scheduler, worker)
    assert out.kv_connector_metadata.held == [request.request_id]
    assert request.request_id not in scheduler.requests
    assert _free_blocks(scheduler) == free


def _saved_then_claimed(scheduler, worker, start: int):
    """A 100-token prompt stored on host by one request, then claimed by a second one (vLLM's
    own prefix cache reset): the second request and the step that claimed it."""
    tokens = prompt_ids(100, start)
    first = make_request(tokens, BLOCK, max_tokens=1)
    scheduler.add_request(first)
    _run_to_end(scheduler, worker, first)
    step(scheduler, worker)
    assert scheduler.reset_prefix_cache()
    second = make_request(tokens, BLOCK, max_tokens=1)
    scheduler.add_request(second)
    return second, scheduler.schedule()    # claimed, blocks allocated, the load not run yet


def test_a_request_aborted_while_it_loads_gives_its_blocks_back(scheduler):
    from vllm.v1.request import RequestStatus

    runtime = scheduler.connector.runtime
    worker = make_worker(runtime, copy_in_step=True)
    free = _free_blocks(scheduler)
    second, out = _saved_then_claimed(scheduler, worker, 500)
    assert second.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    scheduler.finish_requests(second.request_id, RequestStatus.FINISHED_ABORTED)
    step(scheduler, worker, out)               # the worker copies, then reports it received
    step(scheduler, worker)
    assert second.request_id not in scheduler.requests
    assert _free_blocks(scheduler) == free
    assert not runtime.staged and not worker.steps._receiving
    runtime.cache.check_integrity()


def test_a_hit_gone_before_its_load_is_recomputed(scheduler):
    runtime = scheduler.connector.runtime
    worker = make_worker(runtime, copy_in_step=True)
    second, out = _saved_then_claimed(scheduler, worker, 900)
    runtime.release_staged(second.request_id)   # as if the hold were lost before the load
    step(scheduler, worker, out)
    assert runtime.counts["load_errors"] == 1
    _run_to_end(scheduler, worker, second)      # vLLM recomputes what was not loaded
    assert second.num_computed_tokens >= len(second.prompt_token_ids)
