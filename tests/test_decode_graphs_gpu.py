"""Batched decode on the GPU: the split-KV kernels equal the serial paged kernel and plain
attention, and decode steps replayed from CUDA graphs give the eager engine's greedy tokens
(fp32, a small model), with the graphs really captured and serving."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine.request import GenerationRequest
from kvtier.engine.service import EngineService
from test_engine_batching import _prompt
from test_engine_support import make_config
from test_paged_split import _case, _reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("page,kv_heads,n_rep,dim", [(16, 8, 4, 128), (64, 2, 7, 64),
                                                     (7, 4, 1, 128)])
def test_split_kv_equals_the_serial_kernel_and_plain_attention(dtype, tol, page, kv_heads, n_rep,
                                                               dim):
    from kvtier.engine import paged_split, paged_triton

    lengths = [1, 255, 256, 257, 700, 5000, 33]
    query, k, v, table, decodes = _case(lengths, page, kv_heads, n_rep, dtype, dim=dim,
                                        device="cuda")
    split = torch.full(query.shape, float("nan"), dtype=dtype, device="cuda")
    paged_split.split_decode(query, k, v, table, decodes, 0.125,
                             paged_split.splits_for(max(lengths)), split)
    blocks = torch.stack([decodes[:, 0], decodes[:, 1], torch.ones_like(decodes[:, 0]),
                          decodes[:, 2] - 1], 1).contiguous()
    serial = paged_triton.paged_attention(query, k, v, table, blocks, 0.125, 1)
    rows = decodes[:, 1].long()
    torch.testing.assert_close(split[rows].float(), serial[rows].float(), rtol=tol, atol=tol)
    for q_index, want in _reference(query, k, v, table, decodes, 0.125).items():
        torch.testing.assert_close(split[q_index].float(), want, rtol=tol, atol=tol)


def _generate(service: EngineService, prompts: list[list[int]], new: int) -> list[list[int]]:
    handles = [service.submit(GenerationRequest(tuple(p), new)) for p in prompts]
    return [h.result(timeout=600)[0] for h in handles]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_graph_decode_gives_the_eager_decode_tokens(model):
    """Eager, from graphs one step at a time, and from graphs queued a step ahead."""
    prompts = [_prompt(n, i) for i, n in enumerate((37, 5, 300, 16, 61))]
    results, stats = {}, {}
    for name, batch, ahead in (("eager", 0, False), ("graphs", 8, False), ("ahead", 8, True)):
        service = _service_for(model, batch, ahead)
        try:
            results[name] = _generate(service, prompts, 20)        # batched (buckets 8 .. 1)
            results[name] += _generate(service, prompts[2:3], 20)  # alone (bucket 1)
            stats[name] = service.engine.stats()
        finally:
            service.close()
    assert "decode_graphs" not in stats["eager"]
    for name in ("graphs", "ahead"):
        graphs = stats[name]["decode_graphs"]
        assert graphs["disabled"] is None and graphs["captures"] >= 2 and graphs["served"] > 20
        assert results[name] == results["eager"], name
    assert "ahead_steps" not in stats["graphs"] and stats["ahead"]["ahead_rows_taken"] > 20
    assert results["graphs"][2] == results["graphs"][-1]   # alone == batched


def _service_for(model: str, graph_batch: int, ahead: bool = True) -> EngineService:
    config = make_config(**{"engine.model": model, "engine.device": "cuda",
                            "engine.dtype": "float32", "engine.decode_graph_batch": graph_batch,
                            "engine.decode_ahead": str(ahead).lower(),
                            "cache.device_pages": 256, "cache.page_size": 16,
                            "engine.prefill_chunk_tokens": 4096})
    return EngineService.build(config, max_running=8)
