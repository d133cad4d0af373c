"""Prompts stored off vLLM's forward: the saver thread, its bounded queue, held blocks, preemption.

vLLM's real ``Scheduler`` runs the scheduler half; the worker half is driven by hand with CPU
KV tensors laid out as vLLM's CPU backend lays them out. A gate (a call parked on the saver
thread) holds the saver back so each test sees the state while a save is still pending.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from scheduler_harness import (
    HEAD_DIM,
    KV_HEADS,
    make_kv_cache_config,
    make_request,
    make_scheduler,
    make_vllm_config,
    runner_output,
)

from kvtier.errors import ConfigError

BLOCK = 32
pytestmark = pytest.mark.timeout(600)


def _scheduler(model: Path, tmp: Path, **extra):
    config = make_vllm_config(model, {"host_pool_bytes": "8MiB", "staging_pages": 64,
                                      "disk_url": f"file://{tmp / 'disk'}", **extra},
                              block_size=BLOCK, max_batched=256)
    return make_scheduler(config, make_kv_cache_config(BLOCK))


@pytest.fixture(autouse=True)
def _open_gates():
    yield
    while _Gate.opened:
        _Gate.opened.pop().open()


@pytest.fixture
def scheduler(tiny_model: Path, tmp_path: Path):
    sched = _scheduler(tiny_model, tmp_path)
    yield sched
    sched.connector.runtime.close()


def _worker(runtime, copy_in_step: bool = False):
    from kvtier.integrations.vllm.worker import WorkerSide

    worker = WorkerSide(runtime, copy_in_step=copy_in_step)
    kv = {n: torch.randn(256, KV_HEADS, BLOCK, 2 * HEAD_DIM) for n in runtime.shape.layer_names}
    worker.register_kv_caches(kv, "CPU_ATTN")
    return worker


class _Gate:
    """Parks the saver thread on a call until ``open`` (at the latest when the test ends)."""

    opened: list[_Gate] = []

    def __init__(self, saver) -> None:
        self.event = threading.Event()
        self.thread = threading.Thread(target=saver.call, args=(self.event.wait,), daemon=True)
        self.thread.start()
        _Gate.opened.append(self)
        time.sleep(0.05)

    def open(self) -> None:
        self.event.set()
        self.thread.join(10)


def _prompt(n: int, start: int) -> list[int]:
    return [start + i % 900 for i in range(n)]


def test_vllm_keeps_a_finished_requests_blocks_until_its_save_has_copied_them(scheduler):
    runtime = scheduler.connector.runtime
    worker = _worker(runtime)
    request = make_request(_prompt(100, 20), BLOCK, max_tokens=1)
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert [s.req_id for s in out.kv_connector_metadata.saves] == [request.request_id]
    free_before = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    gate = _Gate(runtime.saver)
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
    worker = _worker(runtime)
    request = make_request(_prompt(70, 300), BLOCK, max_tokens=1)
    scheduler.add_request(request)
    out = scheduler.schedule()
    worker.wait_for_save(out.kv_connector_metadata)
    assert runtime.drain(30.0)
    scheduler.update_from_output(out, runner_output(out))
    assert request.request_id not in scheduler.requests
    assert worker.get_finished({request.request_id}) is None


def test_saves_copied_in_the_step_are_committed_before_it_ends_with_no_thread(scheduler):
    """The CUDA flow (run here on CPU tensors): plan, copy and commit inside ``wait_for_save``,
    so the next lookup finds the prompt and never waits on the saver thread's lock."""
    runtime = scheduler.connector.runtime
    worker = _worker(runtime, copy_in_step=True)
    request = make_request(_prompt(100, 20), BLOCK, max_tokens=1)
    scheduler.add_request(request)
    out = scheduler.schedule()
    gate = _Gate(runtime.saver)                  # the saver thread is busy: it must not matter
    worker.wait_for_save(out.kv_connector_metadata)
    assert runtime.counts["saved_tokens"] == 96
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
    worker = _worker(runtime, copy_in_step=True)
    original = getattr(runtime.cache, fault if fault == "commit" else "allocate")

    def broken(*args, **kwargs):
        raise RuntimeError("store fault")
    setattr(runtime.cache, fault if fault == "commit" else "allocate", broken)
    specs = [SaveSpec("x", tuple(_prompt(64, 900)), None, (1, 2))]
    worker.wait_for_save(KvtierConnectorMetadata(saves=specs))
    assert runtime.counts["saves_failed"] == 1
    setattr(runtime.cache, fault if fault == "commit" else "allocate", original)
    worker.wait_for_save(KvtierConnectorMetadata(saves=[SaveSpec("y", specs[0].tokens, None,
                                                                 (3, 4))]))
    assert runtime.counts["saved_tokens"] == 64          # the next save goes through
    assert not runtime.cache.controller.engine_pages     # no staging page left handed out
    runtime.cache.check_integrity()


def test_a_full_save_queue_drops_the_save_counts_it_and_holds_no_blocks(tiny_model, tmp_path):
    from kvtier.integrations.vllm.scheduler import KvtierConnectorMetadata, SaveSpec

    sched = _scheduler(tiny_model, tmp_path, save_queue_depth=1)
    runtime = sched.connector.runtime
    try:
        worker = _worker(runtime)
        gate = _Gate(runtime.saver)
        specs = [SaveSpec(f"r{i}", tuple(_prompt(64, 100 * i)), None, (2 * i, 2 * i + 1))
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
    worker = _worker(runtime)
    copier, original = worker.copier, worker.copier.copy_layer
    in_layer, go_on = threading.Event(), threading.Event()

    def slow_copy(save, layer, kv_layer=None):
        if layer == 1:
            in_layer.set()
            go_on.wait(10)
        original(save, layer, kv_layer)
    copier.copy_layer = slow_copy
    spec = SaveSpec("p", tuple(_prompt(96, 40)), None, (3, 4, 5))
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
    worker = _worker(runtime)
    spec = SaveSpec("a", tuple(_prompt(64, 500)), None, (6, 7))
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
        sched = _scheduler(tiny_model, tmp_path / priority, background_priority=priority)
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
        _scheduler(tiny_model, tmp_path, **{key: value})


def test_a_finished_requests_generated_pages_are_stored_with_its_prompt(scheduler):
    from vllm.v1.request import RequestStatus

    runtime = scheduler.connector.runtime
    worker = _worker(runtime)
    request = make_request(_prompt(40, 700), BLOCK, max_tokens=30)   # 1 prompt page, 2 in all
    scheduler.add_request(request)
    gate = None
    while not RequestStatus.is_finished(request.status):
        out = scheduler.schedule()
        worker.wait_for_save(out.kv_connector_metadata)
        scheduler.update_from_output(out, runner_output(out))
        gate = gate or _Gate(runtime.saver)
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


def test_on_cuda_a_finished_requests_pages_are_copied_in_the_next_step_with_no_thread(scheduler):
    """The CUDA flow (on CPU tensors): the finished request's save rides in the next step's
    metadata, marked held; vLLM keeps its blocks until the worker reports them copied in that
    step, and the saver thread is never involved (a busy one must not matter)."""
    from vllm.v1.request import RequestStatus

    runtime = scheduler.connector.runtime
    runtime.saves_in_step = True
    worker = _worker(runtime, copy_in_step=True)
    gate = _Gate(runtime.saver)
    request = make_request(_prompt(40, 700), BLOCK, max_tokens=30)   # 1 prompt page, 2 in all
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
    connector.worker = _worker(runtime, copy_in_step=True)
    request = make_request(_prompt(40, 700), BLOCK, max_tokens=30)
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
    worker = _worker(runtime, copy_in_step=True)
    tokens = _prompt(60 * BLOCK, 1000)
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
    worker = _worker(runtime, copy_in_step=True)
    tokens = _prompt(60 * BLOCK, 1000)
    fill_kvtier(runtime, tokens[: 40 * BLOCK])
    fill_kvtier(runtime, _prompt(24 * BLOCK, 3000), seed=1)      # the pool is now full
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
