"""Saves copied inside vLLM's step (the CUDA flow, run here on CPU tensors): prompts in
``wait_for_save``, finished requests' pages in the next step with their blocks held, steps vLLM
runs without ``wait_for_save``, faults counted, and the staging pages a save takes.

vLLM's real ``Scheduler`` runs the scheduler half; the worker half is driven by hand
(``save_harness``). A gate parks the saver thread to show it is never waited on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from save_harness import BLOCK, SaverGate, make_worker, prompt_ids, saver_scheduler
from scheduler_harness import make_request, runner_output

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def scheduler(tiny_model: Path, tmp_path: Path):
    sched = saver_scheduler(tiny_model, tmp_path)
    yield sched
    SaverGate.open_all()
    sched.connector.runtime.close()


def test_saves_copied_in_the_step_are_committed_before_it_ends_with_no_thread(scheduler):
    """The CUDA flow (run here on CPU tensors): plan, copy and commit inside ``wait_for_save``,
    so the next lookup finds the prompt and never waits on the saver thread's lock."""
    runtime = scheduler.connector.runtime
    worker = make_worker(runtime, copy_in_step=True)
    request = make_request(prompt_ids(100, 20), BLOCK, max_tokens=1)
    scheduler.add_request(request)
    out = scheduler.schedule()
    gate = SaverGate(runtime.saver)                  # the saver thread is busy: it must not matter
    worker.wait_for_save(out.kv_connector_metadata)
    assert runtime.counts["saved_tokens"] == 96
    assert runtime.counts["save_plan_cpu_us"] > 0 and runtime.counts["save_copy_cpu_us"] > 0
    assert runtime.saver.counts["saves_queued"] == 0
    assert not runtime.saver.hold_blocks(request.request_id)
    scheduler.update_from_output(out, runner_output(out))
    assert request.request_id not in scheduler.requests     # no block held for a copy
    gate.open()
    with runtime.lock:
        assert runtime.cache.match(request.prompt_token_ids).tokens == 96
    runtime.cache.check_integrity()


@pytest.mark.parametrize("fault", ["plan", "commit"])
def test_a_save_that_raises_in_the_step_is_counted_and_never_fails_the_step(scheduler, fault):
    from kvtier.integrations.vllm.scheduler import KvtierConnectorMetadata, SaveSpec

    runtime = scheduler.connector.runtime
    worker = make_worker(runtime, copy_in_step=True)
    original = getattr(runtime.cache, fault if fault == "commit" else "allocate")

    def broken(*args, **kwargs):
        raise RuntimeError("store fault")
    setattr(runtime.cache, fault if fault == "commit" else "allocate", broken)
    specs = [SaveSpec("x", tuple(prompt_ids(64, 900)), None, (1, 2))]
    worker.wait_for_save(KvtierConnectorMetadata(saves=specs))
    assert runtime.counts["saves_failed"] == 1
    setattr(runtime.cache, fault if fault == "commit" else "allocate", original)
    worker.wait_for_save(KvtierConnectorMetadata(saves=[SaveSpec("y", specs[0].tokens, None,
                                                                 (3, 4))]))
    assert runtime.counts["saved_tokens"] == 64          # the next save goes through
    assert not runtime.cache.controller.engine_pages     # no staging page left handed out
    runtime.cache.check_integrity()


def test_on_cuda_a_finished_requests_pages_are_copied_in_the_next_step_with_no_thread(scheduler):
    """The CUDA flow (on CPU tensors): the finished request's save rides in the next step's
    metadata, marked held; vLLM keeps its blocks until the worker reports them copied in that
    step, and the saver thread is never involved (a busy one must not matter)."""
    from vllm.v1.request import RequestStatus

    runtime = scheduler.connector.runtime
    runtime.saves_in_step = True
    worker = make_worker(runtime, copy_in_step=True)
    gate = SaverGate(runtime.saver)
    request = make_request(prompt_ids(40, 700), BLOCK, max_tokens=30)   # 1 prompt page, 2 in all
    scheduler.add_request(request)
    while not RequestStatus.is_finished(request.status):
        out = scheduler.schedule()
        worker.wait_for_save(out.kv_connector_metadata)
        assert worker.get_finished(out.finished_req_ids) is None
        scheduler.update_from_output(out, runner_output(out))
    assert request.request_id in scheduler.requests          # kept for the finish-time save
    free_before = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    step = scheduler.schedule()
    meta = step.kv_connector_metadata
    assert meta.held == [request.request_id]
    assert [s.req_id for s in meta.saves] == [request.request_id]
    worker.wait_for_save(meta)
    tokens = list(request.all_token_ids)
    assert runtime.cache.match(tokens[:64]).tokens == 64      # prompt and output pages
    assert runtime.counts["saved_tokens"] == 32 + 32
    assert runtime.saver.counts["saves_queued"] == 0
    finished = worker.get_finished(step.finished_req_ids)
    assert finished == {request.request_id}
    assert worker.get_finished(set()) is None                 # reported once
    scheduler.update_from_output(step, runner_output(step, finished_sending=finished))
    assert request.request_id not in scheduler.requests
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() > free_before
    assert scheduler.schedule().kv_connector_metadata.held == []
    gate.open()
    runtime.cache.check_integrity()


@pytest.mark.parametrize("forward", ["none", "deferred"])
def test_a_step_whose_saves_vllm_never_waits_for_still_copies_the_held_blocks(scheduler, forward):
    """vLLM 0.26 runs a step without a forward (nothing scheduled, only finished requests
    left) with no ``wait_for_save``, and a deferred finalize asks ``get_finished`` before it:
    the connector stores that step's saves before it reports their blocks free, once."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.request import RequestStatus

    from kvtier.integrations.vllm.connector import KvtierConnector

    runtime = scheduler.connector.runtime
    runtime.saves_in_step = True
    config = scheduler.vllm_config
    connector = KvtierConnector(config, KVConnectorRole.WORKER, scheduler.kv_cache_config)
    assert connector.runtime is runtime
    connector.worker = make_worker(runtime, copy_in_step=True)
    request = make_request(prompt_ids(40, 700), BLOCK, max_tokens=30)
    scheduler.add_request(request)

    def run(out, wait: bool):
        connector.bind_connector_metadata(out.kv_connector_metadata)
        connector.start_load_kv(None)
        if wait:
            connector.wait_for_save()
        done, _ = connector.get_finished(out.finished_req_ids)
        if forward == "deferred":
            connector.wait_for_save()                  # the finalize after the draft model
        connector.clear_connector_metadata()
        return done

    while not RequestStatus.is_finished(request.status):
        out = scheduler.schedule()
        assert run(out, wait=True) is None
        scheduler.update_from_output(out, runner_output(out))
    step = scheduler.schedule()
    assert step.total_num_scheduled_tokens == 0 and step.kv_connector_metadata.held
    done = run(step, wait=False)
    assert done == {request.request_id}
    assert runtime.cache.match(list(request.all_token_ids)[:64]).tokens == 64
    assert runtime.counts["saved_tokens"] == 32 + 32          # stored once
    assert connector.worker.get_finished(set()) is None       # and reported once
    scheduler.update_from_output(step, runner_output(step, finished_sending=done))
    assert request.request_id not in scheduler.requests
    runtime.cache.check_integrity()


def test_a_save_whose_head_a_load_pins_needs_staging_for_its_tail_only(scheduler):
    """64 staging pages; a load pins a 40-page head on kvtier's device tier: storing head and
    a 20-page tail needs 20 fresh pages, not 60 (which the pool cannot give while the head is
    pinned), and copies only the tail."""
    from scheduler_harness import fill_kvtier

    from kvtier.integrations.vllm.scheduler import KvtierConnectorMetadata, SaveSpec

    runtime = scheduler.connector.runtime
    worker = make_worker(runtime, copy_in_step=True)
    tokens = prompt_ids(60 * BLOCK, 1000)
    fill_kvtier(runtime, tokens[: 40 * BLOCK])
    with runtime.lock:
        pinned = runtime.cache.load(runtime.cache.match(tokens[: 40 * BLOCK]))
    assert runtime.cache.device_pool.num_pages == 64
    spec = SaveSpec("tail", tuple(tokens), None, tuple(range(1, 61)))
    worker.wait_for_save(KvtierConnectorMetadata(saves=[spec]))
    assert runtime.counts["saves_refused_no_staging"] == 0
    assert runtime.counts["saved_tokens"] == 20 * BLOCK
    with runtime.lock:
        assert runtime.cache.match(tokens).tokens == 60 * BLOCK
        runtime.cache.release(pinned)
    runtime.cache.check_integrity()


def test_a_save_whose_unpinned_head_is_evicted_for_its_tail_stores_the_whole_prompt(scheduler):
    """The pool is full and the head is the least recently used: allocating the tail evicts
    head pages, so the save takes pages for all of it instead (none refused)."""
    from scheduler_harness import fill_kvtier

    from kvtier.integrations.vllm.scheduler import KvtierConnectorMetadata, SaveSpec

    runtime = scheduler.connector.runtime
    worker = make_worker(runtime, copy_in_step=True)
    tokens = prompt_ids(60 * BLOCK, 1000)
    fill_kvtier(runtime, tokens[: 40 * BLOCK])
    fill_kvtier(runtime, prompt_ids(24 * BLOCK, 3000), seed=1)      # the pool is now full
    with runtime.lock:
        assert runtime.cache.match(tokens).tokens_by_tier.get("device", 0) == 40 * BLOCK
    spec = SaveSpec("tail", tuple(tokens), None, tuple(range(1, 61)))
    worker.wait_for_save(KvtierConnectorMetadata(saves=[spec]))
    assert runtime.counts["saves_refused_no_staging"] == 0
    with runtime.lock:
        hit = runtime.cache.match(tokens)
    assert hit.tokens == 60 * BLOCK
    assert hit.tokens_by_tier["device"] == 60 * BLOCK
    assert runtime.counts["saved_tokens"] == 60 * BLOCK         # the head copied again too
    runtime.cache.check_integrity()



def test_a_save_whose_head_is_on_host_only_copies_its_new_pages_straight_to_host(scheduler):
    """A request finishing (or a prompt extending one) whose 40-page head kvtier holds on host
    but no longer on its device tier: only the 20 new pages are copied, and they go to host
    (``commit_tail``), not the head again through kvtier's device tier. The stored pages hold
    vLLM's rows."""
    import torch
    from scheduler_harness import fill_kvtier

    from kvtier.integrations.vllm.scheduler import KvtierConnectorMetadata, SaveSpec

    runtime = scheduler.connector.runtime
    cache, page = runtime.cache, runtime.page_size
    worker = make_worker(runtime, copy_in_step=True)
    tokens = prompt_ids(60 * page, 1000)
    fill_kvtier(runtime, tokens[: 40 * page])
    with runtime.lock:
        cache.clear_tier("device")
    block_ids = tuple(range(1, 60 * page // BLOCK + 1))
    worker.wait_for_save(KvtierConnectorMetadata(saves=[SaveSpec("long", tuple(tokens), None,
                                                                 block_ids)]))
    assert runtime.counts["saves_to_host_only"] == 1
    assert runtime.counts["saved_tokens"] == 20 * page
    with runtime.lock:
        assert cache.drain(5.0)
        hit = cache.match(tokens)
        assert hit.tokens_by_tier == {"device": 0, "host": 60 * page, "disk": 0, "remote": 0}
        loaded = cache.load(hit)
    try:
        pool = cache.device_pool.kv
        for layer, name in enumerate(runtime.shape.layer_names):
            for page_no in (40, 59):
                rows = torch.arange(page_no * page, (page_no + 1) * page)
                slots = torch.tensor(block_ids)[rows // BLOCK] * BLOCK + rows % BLOCK
                keys, values = worker.layout.read(worker.kv_caches[name], slots)
                page_id = loaded.device_page_ids[page_no]
                assert torch.equal(pool[layer, 0, page_id], keys.to(pool.dtype))
                assert torch.equal(pool[layer, 1, page_id], values.to(pool.dtype))
    finally:
        with runtime.lock:
            cache.release(loaded)
    cache.check_integrity()


def test_a_save_finds_pages_whose_host_copies_finished_since_the_last_poll(scheduler,
                                                                          monkeypatch):
    """Every staging page is locked by a host copy that has landed but that nothing has polled
    yet (on CUDA a copy locks its pages until a poll reaps it): the save still gets its pages
    (``allocate`` reaps finished copies) instead of being refused."""
    from kvtier.integrations.vllm.scheduler import KvtierConnectorMetadata, SaveSpec
    from kvtier.transfer.copy_engine import Ticket

    runtime = scheduler.connector.runtime
    cache = runtime.cache
    worker = make_worker(runtime, copy_in_step=True)
    landed = {"yes": False}
    monkeypatch.setattr(Ticket, "is_done", lambda self: landed["yes"])
    with runtime.lock:   # 64 pages committed, their host copies in flight
        assert cache.device_pool.num_pages == 64
        cache.commit(prompt_ids(64 * BLOCK, 5000), cache.allocate(64))
    landed["yes"] = True   # the copies land; nothing has polled since
    tokens = prompt_ids(20 * BLOCK, 1000)
    spec = SaveSpec("late", tuple(tokens), None, tuple(range(1, 21)))
    worker.wait_for_save(KvtierConnectorMetadata(saves=[spec]))
    assert runtime.counts["saves_refused_no_staging"] == 0
    assert runtime.counts["saved_tokens"] == 20 * BLOCK
    with runtime.lock:
        assert cache.match(tokens).tokens == 20 * BLOCK
    cache.check_integrity()


def test_saves_refused_for_staging_are_counted_and_said_at_powers_of_two(scheduler, monkeypatch,
                                                                         caplog):
    """With no staging page to be had, each save is refused and counted; the log says so at the
    1st, 2nd and 4th refusal, not at the 3rd, naming staging_pages."""
    import logging

    from kvtier.errors import PoolExhausted
    from kvtier.integrations.vllm.scheduler import KvtierConnectorMetadata, SaveSpec

    runtime = scheduler.connector.runtime
    worker = make_worker(runtime, copy_in_step=True)

    def allocate(n: int) -> list[int]:
        raise PoolExhausted("every staging page is in use")

    monkeypatch.setattr(runtime.cache, "allocate", allocate)
    said = []
    for i in range(4):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvtier.integrations.vllm.saves"):
            spec = SaveSpec(f"r{i}", tuple(prompt_ids(20 * BLOCK, 7000 + i)), None,
                            tuple(range(1, 21)))
            worker.wait_for_save(KvtierConnectorMetadata(saves=[spec]))
        said.append(any("staging_pages" in r.getMessage() for r in caplog.records))
    assert runtime.counts["saves_refused_no_staging"] == 4
    assert runtime.counts["saved_tokens"] == 0
    assert said == [True, True, False, True]
    runtime.cache.check_integrity()
