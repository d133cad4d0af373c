"""Workers in processes of their own: vLLM's real ``Scheduler`` at TP=2, two ``RankWorker``s.

The scheduler stages hits into the shared staging pool and names its pages in the step's
metadata; each rank copies its KV head out of them and fills its head of a save; the step ends
(pages released, saves committed) only once every rank reported it through the worker metadata
vLLM aggregates. The ranks run here in this process, on CPU tensors laid out as vLLM's CPU
backend lays out one rank's KV (one of the two heads).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scheduler_harness import (
    HEAD_DIM,
    fill_kvtier,
    make_kv_cache_config,
    make_request,
    make_scheduler,
    make_vllm_config,
    runner_output,
)

from kvtier.integrations.vllm.layout import BlockLayout
from kvtier.integrations.vllm.rank_steps import KvtierWorkerMeta
from kvtier.integrations.vllm.rank_worker import RankWorker
from kvtier.integrations.vllm.runtime import RankRuntime

BLOCK = 32
NUM_BLOCKS = 64
pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def ranked(tiny_model: Path, tmp_path: Path):
    config = make_vllm_config(tiny_model, {"disk_url": f"file://{tmp_path / 'disk'}",
                                           "host_pool_bytes": "8MiB", "staging_pages": 64},
                              block_size=BLOCK, max_batched=256, tp=2)
    sched = make_scheduler(config, make_kv_cache_config(BLOCK, kv_heads=1))
    runtime = sched.connector.runtime
    ranks = []
    for rank in range(2):
        worker = RankWorker(RankRuntime(runtime.options, runtime.shape), rank)
        worker.register_kv_caches({n: torch.randn(NUM_BLOCKS, 1, BLOCK, 2 * HEAD_DIM)
                                   for n in runtime.shape.layer_names}, "CPU_ATTN")
        ranks.append(worker)
    yield sched, ranks
    sched.connector.runtime.close()


def _prompt(n: int, start: int = 10) -> list[int]:
    return [start + i % 900 for i in range(n)]


def _run_step(ranks: list[RankWorker], meta, report=(0, 1),
              finished: set[str] | None = None) -> KvtierWorkerMeta | None:
    """Each rank runs the step as vLLM's model runner would; the reports of ``report`` summed
    (and, into ``finished``, the requests every rank reported done with their blocks)."""
    out = None
    done: list[set[str]] = []
    for rank, worker in enumerate(ranks):
        worker.start_load_kv(meta)
        for name in worker.runtime.shape.layer_names:
            worker.wait_for_layer_load(name)
        worker.wait_for_save(meta)
        done.append(worker.get_finished(set()) or set())
        got = worker.build_worker_meta()
        if rank in report and got is not None:
            out = got if out is None else out.aggregate(got)
    if finished is not None:
        finished |= set.intersection(*done)
    return out


def _rows(worker: RankWorker, layer: int, block_ids, count: int):
    layout = BlockLayout("cpu", NUM_BLOCKS, BLOCK, 1, HEAD_DIM)
    slots = torch.cat([torch.arange(b * BLOCK, (b + 1) * BLOCK) for b in block_ids])[:count]
    return layout.read(worker.kv_caches[layer], slots)


def test_each_rank_loads_its_own_head_of_the_staged_pages(ranked):
    sched, ranks = ranked
    runtime = sched.connector.runtime
    tokens = _prompt(100)
    fill_kvtier(runtime, tokens)
    expected = runtime.cache.device_pool.kv.clone()
    request = make_request(tokens, BLOCK)
    sched.add_request(request)
    out = sched.schedule()
    meta = out.kv_connector_metadata
    (load,) = meta.loads
    assert meta.step >= 1 and meta.pool is not None and len(load.pages) == 3
    assert (load.start, load.end) == (0, 96)
    worker_meta = _run_step(ranks, meta)
    blocks = out.scheduled_new_reqs[0].block_ids[0][:3]
    rows = torch.tensor(load.pages).repeat_interleave(BLOCK) * BLOCK + torch.arange(96) % BLOCK
    for rank, worker in enumerate(ranks):
        for layer in range(len(worker.kv_caches)):
            keys, values = _rows(worker, layer, blocks, 96)
            want_k = expected[layer, 0].flatten(0, 1)[rows, rank:rank + 1]
            want_v = expected[layer, 1].flatten(0, 1)[rows, rank:rank + 1]
            assert torch.equal(keys, want_k) and torch.equal(values, want_v)
    steps = sched.connector.scheduler.ranked
    assert list(steps._pending) == [meta.step]         # its pages stay pinned until then
    sched.update_from_output(out, runner_output(out, worker_meta=worker_meta))
    assert steps._pending == {} and runtime.staged == {}


def _save_step(sched, tokens):
    request = make_request(tokens, BLOCK)
    sched.add_request(request)
    out = sched.schedule()
    (save,) = out.kv_connector_metadata.saves
    return request, out, save


def test_a_save_is_committed_once_every_rank_filled_its_head(ranked):
    sched, ranks = ranked
    runtime = sched.connector.runtime
    tokens = _prompt(64, start=300)
    request, out, save = _save_step(sched, tokens)
    assert len(save.pages) == 2 and save.start == 0
    blocks = out.scheduled_new_reqs[0].block_ids[0][:2]
    only_first = _run_step(ranks, out.kv_connector_metadata, report=(0,))
    sched.update_from_output(out, runner_output(out, worker_meta=only_first))
    assert runtime.saver.drain(30.0)
    assert runtime.cache.match(tokens).tokens == 0          # one rank's report ends nothing
    both = only_first.aggregate(KvtierWorkerMeta(done={out.kv_connector_metadata.step: 1}))
    sched.connector.update_connector_output(runner_output(out, worker_meta=both)
                                            .kv_connector_output)
    assert runtime.saver.drain(30.0)
    assert runtime.cache.match(tokens).tokens == 64
    pool = runtime.cache.device_pool.kv
    rows = torch.tensor(save.pages).repeat_interleave(BLOCK) * BLOCK + torch.arange(64) % BLOCK
    for rank, worker in enumerate(ranks):
        for layer in range(len(worker.kv_caches)):
            keys, values = _rows(worker, layer, blocks, 64)
            assert torch.equal(pool[layer, 0].flatten(0, 1)[rows, rank:rank + 1], keys)
            assert torch.equal(pool[layer, 1].flatten(0, 1)[rows, rank:rank + 1], values)


def test_a_step_a_rank_failed_abandons_its_saves(ranked):
    sched, ranks = ranked
    runtime = sched.connector.runtime
    tokens = _prompt(64, start=500)
    _, out, _ = _save_step(sched, tokens)
    step = out.kv_connector_metadata.step
    free_before = runtime.cache.device_pool.allocator.stats()["free"]
    _run_step(ranks, out.kv_connector_metadata)
    failed = KvtierWorkerMeta(done={step: 1}, failed={step: 1})
    sched.update_from_output(out, runner_output(out, worker_meta=failed))
    assert runtime.saver.drain(30.0)
    assert runtime.cache.match(tokens).tokens == 0
    assert runtime.counts["saves_failed_on_a_rank"] == 1
    assert runtime.cache.device_pool.allocator.stats()["free"] > free_before


def test_a_rank_that_cannot_map_the_pool_reports_its_loads_as_errors(ranked):
    sched, ranks = ranked
    runtime = sched.connector.runtime
    tokens = _prompt(100, start=700)
    fill_kvtier(runtime, tokens)
    sched.add_request(make_request(tokens, BLOCK))
    out = sched.schedule()
    meta = out.kv_connector_metadata
    from dataclasses import replace

    broken = replace(meta.pool, path=meta.pool.path + ".gone")
    worker = ranks[1]
    worker._pool_ref = None
    meta.pool = broken
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    reported = worker.build_worker_meta()
    assert reported is not None and reported.failed == {meta.step: 1}
    blocks = set(out.scheduled_new_reqs[0].block_ids[0][:3])
    assert worker.get_block_ids_with_load_errors() == blocks
    assert worker.runtime.counts["pool_map_errors"] == 1


def test_a_finished_request_keeps_its_blocks_until_the_ranks_copied_its_output(ranked):
    sched, ranks = ranked
    runtime = sched.connector.runtime
    tokens = _prompt(60, start=100)
    request = make_request(tokens, BLOCK, max_tokens=8)
    sched.add_request(request)
    steps = 0
    held_step = None
    while request.request_id in sched.requests and steps < 20:
        out = sched.schedule()
        meta = out.kv_connector_metadata
        finished: set[str] = set()
        worker_meta = _run_step(ranks, meta, finished=finished)
        if request.request_id in meta.held:
            held_step = meta.step
        sched.update_from_output(out, runner_output(
            out, worker_meta=worker_meta, finished_sending=finished or None))
        steps += 1
    assert held_step is not None                       # the output's page was copied then
    assert request.request_id not in sched.requests   # and vLLM freed the blocks after
    assert runtime.saver.drain(30.0)
    assert runtime.cache.match(request.all_token_ids).tokens == 64
    assert runtime.counts["generated_saves"] == 1
