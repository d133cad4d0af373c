"""How a hit's copies are shaped: the scheduler half asks for the host -> staging copy layer by
layer when a forward is left to overlap it, else as one copy of every layer (which
``host.copy_path`` ``auto`` sends through the GPU's copy engines), and marks a step a full CUDA
graph may replay, whose loads the worker copies whole. vLLM's real ``Scheduler`` runs the
scheduler half."""

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


def test_a_step_small_enough_for_a_full_graph_copies_its_loads_whole(scheduler):
    """A step vLLM may replay as a full CUDA graph runs no per-layer hook: the scheduler marks
    it, and the worker then copies every layer of its loads before the forward."""
    runtime = scheduler.connector.runtime
    runtime.shape = dataclasses.replace(runtime.shape, full_graph_tokens=8)
    tokens = [10 + i for i in range(96)]
    fill_kvtier(runtime, tokens)
    scheduler.add_request(make_request(tokens, BLOCK))
    small = scheduler.schedule()                    # one token left to compute: a graph step
    assert small.kv_connector_metadata.loads and small.kv_connector_metadata.whole_loads
    longer = [400 + i for i in range(96)] + [20 + i for i in range(40)]
    fill_kvtier(runtime, longer[:96])
    scheduler.add_request(make_request(longer, BLOCK))
    large = scheduler.schedule()                    # 40 tokens to compute: never a full graph
    assert large.kv_connector_metadata.loads and not large.kv_connector_metadata.whole_loads


def test_the_largest_full_graph_step_is_read_from_vllms_compilation_config(tiny_model):
    from types import SimpleNamespace

    from vllm.config import CompilationConfig, CUDAGraphMode, ModelConfig

    from kvtier.integrations.vllm.compat import full_graph_max_tokens

    model = ModelConfig(model=str(tiny_model), dtype="float32", seed=0, max_model_len=2048)
    full = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                             cudagraph_capture_sizes=[1, 2, 4, 8, 16])
    assert full_graph_max_tokens(SimpleNamespace(model_config=model,
                                                 compilation_config=full)) == 16
    pieces = CompilationConfig(cudagraph_mode=CUDAGraphMode.PIECEWISE,
                               cudagraph_capture_sizes=[1, 2, 4, 8, 16])
    assert full_graph_max_tokens(SimpleNamespace(model_config=model,
                                                 compilation_config=pieces)) == 0
    eager = ModelConfig(model=str(tiny_model), dtype="float32", seed=0, max_model_len=2048,
                        enforce_eager=True)
    assert full_graph_max_tokens(SimpleNamespace(model_config=eager,
                                                 compilation_config=full)) == 0
