"""How the scheduler half asks for a hit's host -> staging copy: layer by layer when a forward is
left to overlap it, else as one copy of every layer (which ``host.copy_path`` ``auto`` sends
through the GPU's copy engines). vLLM's real ``Scheduler`` runs the scheduler half."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from scheduler_harness import (
    fill_kvtier,
    make_kv_cache_config,
    make_request,
    make_scheduler,
    make_vllm_config,
)

BLOCK = 32
pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def scheduler(tiny_model: Path, tmp_path: Path):
    config = make_vllm_config(tiny_model, {"host_pool_bytes": "8MiB", "staging_pages": 64},
                              block_size=BLOCK, max_batched=256)
    sched = make_scheduler(config, make_kv_cache_config(BLOCK))
    yield sched
    sched.connector.runtime.close()


def _loads_asked(scheduler, prompts: list[list[int]]) -> list[bool]:
    runtime = scheduler.connector.runtime
    asked: list[bool] = []
    load = runtime.cache.load

    def spy(hit, **kwargs):
        asked.append(kwargs["layerwise"])
        return load(hit, **kwargs)
    runtime.cache.load = spy
    for tokens in prompts:
        scheduler.add_request(make_request(tokens, BLOCK))
        scheduler.schedule()
    return asked


@pytest.mark.parametrize(("full_graph", "want"), [(0, [False, True]), (512, [False, False])])
def test_a_hit_loads_layer_by_layer_only_with_a_forward_left_to_overlap(scheduler, full_graph,
                                                                          want):
    runtime = scheduler.connector.runtime
    runtime.shape = dataclasses.replace(runtime.shape, full_graph_tokens=full_graph)
    heads = [[10 + i for i in range(64)], [200 + i for i in range(64)]]
    for head in heads:                                # two heads: vLLM's own prefix cache
        fill_kvtier(runtime, head)                    # must not serve the second prompt
    short = heads[0] + [900, 901, 902, 903]           # 4 tokens left: at most a page
    long = heads[1] + [500 + i for i in range(100)]   # 100 left: more than a page
    assert _loads_asked(scheduler, [short, long]) == want

