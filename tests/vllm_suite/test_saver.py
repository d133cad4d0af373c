"""Prompts stored by the saver thread (vLLM's CPU backend in one process): its bounded queue,
held blocks, preemption, its threads' priority.

vLLM's real ``Scheduler`` runs the scheduler half; the worker half is driven by hand
(``save_harness``). Saves copied inside the step (CUDA) are in ``test_saves_in_step.py``.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from save_harness import BLOCK, SaverGate, make_worker, prompt_ids, saver_scheduler
from scheduler_harness import make_request, runner_output

from kvtier.errors import ConfigError

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(autouse=True)
def _open_gates():
    yield
    SaverGate.open_all()


@pytest.fixture
def scheduler(tiny_model: Path, tmp_path: Path):
    sched = saver_scheduler(tiny_model, tmp_path)
    yield sched
    sched.connector.runtime.close()


def test_vllm_keeps_a_finished_requests_blocks_until_its_save_has_copied_them(scheduler):
    runtime = scheduler.connector.runtime
    worker = make_worker(runtime)
    request = make_request(prompt_ids(100, 20), BLOCK, max_tokens=1)
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert [s.req_id for s in out.kv_connector_metadata.saves] == [request.request_id]
    free_before = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    gate = SaverGate(runtime.saver)
    worker.wait_for_save(out.kv_connector_metadata)          # queued, not copied
    scheduler.update_from_output(out, runner_output(out))    # one token: the request finishes
    assert request.request_id in scheduler.requests           # vLLM kept it for the save
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
    assert worker.get_finished({request.request_id}) is None
    gate.open()
    assert runtime.drain(30.0)
    assert runtime.counts["saved_tokens"] == 96
    assert worker.get_finished(set()) == {request.request_id}
    assert worker.get_finished(set()) is None                 # reported once
    idle = scheduler.schedule()
    scheduler.update_from_output(idle, runner_output(idle, finished_sending={request.request_id}))
    assert request.request_id not in scheduler.requests
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() > free_before
    runtime.cache.check_integrity()


def test_a_request_whose_save_already_copied_frees_its_blocks_at_once(scheduler):
    runtime = scheduler.connector.runtime
    worker = make_worker(runtime)
    request = make_request(prompt_ids(70, 300), BLOCK, max_tokens=1)
    scheduler.add_request(request)
    out = scheduler.schedule()
    worker.wait_for_save(out.kv_connector_metadata)
    assert runtime.drain(30.0)
    scheduler.update_from_output(out, runner_output(out))
    assert request.request_id not in scheduler.requests
    assert worker.get_finished({request.request_id}) is None


def test_a_full_save_queue_drops_the_save_counts_it_and_holds_no_blocks(tiny_model, tmp_path):
    from kvtier.integrations.vllm.scheduler import KvtierConnectorMetadata, SaveSpec

    sched = saver_scheduler(tiny_model, tmp_path, save_queue_depth=1)
    runtime = sched.connector.runtime
    try:
        worker = make_worker(runtime)
        gate = SaverGate(runtime.saver)
        specs = [SaveSpec(f"r{i}", tuple(prompt_ids(64, 100 * i)), None, (2 * i, 2 * i + 1))
                 for i in range(1, 3)]
        worker.wait_for_save(KvtierConnectorMetadata(saves=specs))
        assert runtime.saver.counts["saves_dropped_queue_full"] == 1
        assert not runtime.saver.hold_blocks("r2")             # the dropped one holds nothing
        assert runtime.saver.hold_blocks("r1")
        gate.open()
        assert runtime.drain(30.0)
        assert runtime.counts["saved_tokens"] == 64
        assert worker.get_finished({"r1", "r2"}) == {"r1"}
        runtime.cache.check_integrity()
    finally:
        runtime.close()


def test_cancelling_a_preempted_save_waits_out_the_layer_being_copied(scheduler):
    from kvtier.integrations.vllm.scheduler import KvtierConnectorMetadata, SaveSpec

    runtime = scheduler.connector.runtime
    worker = make_worker(runtime)
    copier, original = worker.copier, worker.copier.copy_layer
    in_layer, go_on = threading.Event(), threading.Event()

    def slow_copy(save, layer, kv_layer=None):
        if layer == 1:
            in_layer.set()
            go_on.wait(10)
        original(save, layer, kv_layer)
    copier.copy_layer = slow_copy
    spec = SaveSpec("p", tuple(prompt_ids(96, 40)), None, (3, 4, 5))
    worker.wait_for_save(KvtierConnectorMetadata(saves=[spec]))
    assert in_layer.wait(10)
    returned = threading.Event()
    canceller = threading.Thread(target=lambda: (worker.handle_preemptions(
        KvtierConnectorMetadata(preempted=["p"])), returned.set()))
    canceller.start()
    time.sleep(0.2)
    assert not returned.is_set()                 # layer 1 is still being copied
    go_on.set()
    canceller.join(10)
    assert returned.is_set()
    assert runtime.drain(30.0)
    assert runtime.saver.counts["saves_cancelled"] == 1
    assert runtime.counts.get("saved_tokens", 0) == 0
    assert runtime.cache.match(spec.tokens).tokens == 0
    runtime.cache.check_integrity()


def test_a_prompt_kvtier_holds_on_some_tier_is_not_copied_again(scheduler):
    from kvtier.integrations.vllm.scheduler import KvtierConnectorMetadata, SaveSpec

    runtime = scheduler.connector.runtime
    worker = make_worker(runtime)
    spec = SaveSpec("a", tuple(prompt_ids(64, 500)), None, (6, 7))
    worker.wait_for_save(KvtierConnectorMetadata(saves=[spec]))
    assert runtime.drain(30.0)
    with runtime.lock:
        runtime.cache.clear_tier("device")       # now only the host tier and the disk hold it
    again = SaveSpec("b", spec.tokens, None, (8, 9))
    worker.wait_for_save(KvtierConnectorMetadata(saves=[again]))
    assert runtime.drain(30.0)
    assert runtime.counts["saves_skipped_held"] == 1
    assert runtime.counts["saved_tokens"] == 64


def test_the_saver_and_kvtiers_io_threads_run_at_idle_priority(tiny_model, tmp_path):
    for priority, policy in (("idle", os.SCHED_IDLE), ("normal", os.SCHED_OTHER)):
        sched = saver_scheduler(tiny_model, tmp_path / priority, background_priority=priority)
        try:
            names = ("kvtier-vllm-saver", "kvtier-io")
            threads = [t for t in threading.enumerate() if t.name.startswith(names)]
            assert {t.name.split("-")[1] for t in threads} == {"vllm", "io"}
            assert {os.sched_getscheduler(t.native_id) for t in threads} == {policy}
            assert os.sched_getscheduler(0) == os.SCHED_OTHER    # vLLM's own thread is untouched
        finally:
            sched.connector.runtime.close()


@pytest.mark.parametrize(("key", "value"), [("background_priority", "low"),
                                            ("save_queue_depth", 0)])
def test_a_bad_saver_setting_is_refused_at_start(tiny_model, tmp_path, key, value):
    with pytest.raises(ConfigError, match=key):
        saver_scheduler(tiny_model, tmp_path, **{key: value})


def test_a_finished_requests_generated_pages_are_stored_with_its_prompt(scheduler):
    from vllm.v1.request import RequestStatus

    runtime = scheduler.connector.runtime
    worker = make_worker(runtime)
    request = make_request(prompt_ids(40, 700), BLOCK, max_tokens=30)   # 1 prompt page, 2 in all
    scheduler.add_request(request)
    gate = None
    while not RequestStatus.is_finished(request.status):
        out = scheduler.schedule()
        worker.wait_for_save(out.kv_connector_metadata)
        scheduler.update_from_output(out, runner_output(out))
        gate = gate or SaverGate(runtime.saver)
    assert request.request_id in scheduler.requests          # kept for the finish-time save
    gate.open()
    assert runtime.drain(30.0)
    tokens = list(request.all_token_ids)
    assert runtime.counts["generated_saves"] == 1
    assert runtime.cache.match(tokens[:64]).tokens == 64      # prompt and output pages
    assert runtime.counts["saved_tokens"] == 32 + 32        # the prompt page was held: reused
    assert worker.get_finished({request.request_id}) == {request.request_id}


def test_the_saver_runs_torch_ops_on_its_own_thread_and_leaves_other_threads_counts():
    from kvtier.integrations.vllm.saver import Saver

    before = torch.get_num_threads()
    saver = Saver(depth=2, priority="normal")
    try:
        on_saver = saver.call(torch.get_num_threads)
        started_later: list[int] = []
        later = threading.Thread(target=lambda: started_later.append(torch.get_num_threads()))
        later.start()
        later.join()
    finally:
        saver.close(1.0)
    assert on_saver == 1
    assert torch.get_num_threads() == before
    assert started_later == [before]
