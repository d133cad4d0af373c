"""A lone hit's suffix on the GPU: replayed from captured paged graphs it gives the eager
batched step's logits (the same kernels: bit-identical in bf16 and fp32 up to the GEMMs' row
count) and the same greedy tokens, for device and host hits, with the graphs really serving;
the flash prefill kernel gives a prompt the same bits whole, in steps and as a suffix, and the
split launch gives its bits."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine import paged
from kvtier.engine.request import GenerationRequest
from kvtier.engine.service import EngineService
from kvtier.engine.suffix_step import SuffixStep
from test_engine_batching import _prompt
from test_engine_support import make_config

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kv_heads,n_rep,dim,page", [(8, 4, 128, 64), (2, 7, 64, 16)])
@pytest.mark.parametrize("start,count", [(0, 300), (255, 1), (4096, 8), (33000, 32)])
def test_the_split_prefill_gives_the_flash_kernels_bits(dtype, kv_heads, n_rep, dim, page,
                                                         start, count):
    from kvtier.engine import paged_prefill_split, paged_triton

    gen = torch.Generator(device="cuda").manual_seed(start + count)
    pages = -(-(start + count) // page)
    k = torch.randn(pages + 1, page, kv_heads, dim, device="cuda", generator=gen).to(dtype)
    v = torch.randn(pages + 1, page, kv_heads, dim, device="cuda", generator=gen).to(dtype)
    table = torch.randperm(pages + 1, device="cuda", generator=gen)[None].to(torch.int32)
    query = torch.randn(count, kv_heads * n_rep, dim, device="cuda", generator=gen).to(dtype)
    per_block = paged_triton.MAX_ROWS // n_rep
    blocks = torch.as_tensor([(0, off, min(per_block, count - off), start + off)
                              for off in range(0, count, per_block)], dtype=torch.int32,
                             device="cuda")
    serial = paged_triton.paged_attention(query, k, v, table, blocks, dim ** -0.5, per_block)
    parts = paged_prefill_split.partials(blocks.shape[0], kv_heads,
                                         -(-(start + count) // paged_triton.CHUNK_TOKENS), dim,
                                         query.device)
    split = paged_prefill_split.split_prefill(query, k, v, table, blocks, dim ** -0.5,
                                              torch.empty_like(query), parts)
    assert torch.equal(split, serial)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page", [64, 16])
def test_a_prompt_whole_in_steps_and_as_a_suffix_gives_the_same_bits(dtype, page):
    """The flash kernel on the tensor cores (bf16) and in IEEE fp32: any split of a prompt
    into steps, and its end as a hit's suffix, give the whole prompt's bits."""
    from kvtier.engine import paged_triton

    kv_heads, n_rep, dim, total = 8, 4, 128, 5000
    gen = torch.Generator(device="cuda").manual_seed(page)
    pages = -(-total // page)
    k = torch.randn(pages, page, kv_heads, dim, device="cuda", generator=gen).to(dtype)
    v = torch.randn(pages, page, kv_heads, dim, device="cuda", generator=gen).to(dtype)
    table = torch.randperm(pages, device="cuda", generator=gen)[None].to(torch.int32)
    query = torch.randn(total, kv_heads * n_rep, dim, device="cuda", generator=gen).to(dtype)
    per = paged_triton.tokens_per_tile(n_rep)

    def run(start: int, count: int) -> torch.Tensor:
        blocks = torch.as_tensor([(0, off, min(per, count - off), start + off)
                                  for off in range(0, count, per)], dtype=torch.int32,
                                 device="cuda")
        return paged_triton.paged_attention(query[start:start + count], k, v, table, blocks,
                                            dim ** -0.5, per)

    whole = run(0, total)
    for size in (2048, 1000, 77):
        steps = torch.cat([run(s, min(size, total - s)) for s in range(0, total, size)])
        assert torch.equal(steps, whole), size
    for past in (4096, total - 33, total - 1):
        assert torch.equal(run(past, total - past), whole[past:]), past


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("past,new", [(64, 1), (512, 9), (2048, 77), (4096, 20)])
def test_captured_suffix_gives_the_eager_steps_logits(dtype, past, new):
    service = _service("tiny-llama", dtype, 8192)
    try:
        lm, pool = service.lm, service.engine.pages.kv
        step = SuffixStep(lm, 8192, service.engine.pages.scratch_page)
        assert step.warm(pool) == 5 and step.disabled is None
        pages = service.engine.pages.tiered.allocate(-(-(past + new) // 16))
        tokens = _prompt(past + new, 3)
        prefix = paged.BatchRow(pages, 0, tokens[:past])
        suffix = paged.BatchRow(pages, past, tokens[past:])
        paged.forward_batch(lm, [prefix], pool)
        eager = paged.forward_batch(lm, [suffix], pool)
        eager_kv = pool[:, :, pages].clone()
        captured = step.run(suffix, pool)
        captured_kv = pool[:, :, pages].clone()
    finally:
        service.close()
    assert captured is not None and step.served == 1
    assert captured.argmax(-1).tolist() == eager.argmax(-1).tolist()
    tol = 1e-4 if dtype == "float32" else 2e-2
    torch.testing.assert_close(captured, eager, rtol=tol, atol=tol)
    torch.testing.assert_close(captured_kv, eager_kv, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_served_hit_gives_the_same_tokens_with_and_without_suffix_graphs(dtype):
    prompts = [_prompt(600, 1) + _prompt(n, 10 + i) for i, n in enumerate((3, 40, 100))]
    results, stats = {}, {}
    for name, graph_tokens in (("eager", 0), ("graphs", 8192)):
        service = _service("tiny-llama", dtype, graph_tokens)
        try:
            service.generate(GenerationRequest(tuple(prompts[0][:600] + [7]), 1), timeout=300)
            results[name] = [service.generate(GenerationRequest(tuple(p), 16), timeout=300)[0]
                             for p in prompts]
            stats[name] = service.engine.stats()
        finally:
            service.close()
    assert "suffix_graphs" not in stats["eager"]
    assert stats["graphs"]["suffix_graph_steps"] == len(prompts)
    assert results["graphs"] == results["eager"]


def _service(model: str, dtype: str, graph_tokens: int) -> EngineService:
    config = make_config(**{"engine.model": model, "engine.device": "cuda",
                            "engine.dtype": dtype, "engine.graph_tokens": graph_tokens,
                            "cache.device_pages": 512, "cache.page_size": 16,
                            "engine.prefill_chunk_tokens": 4096})
    return EngineService.build(config, max_running=4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("start,count", [(0, 5000), (4096, 77), (33000, 1)])
def test_descriptor_loads_give_the_pointer_loads_bits(dtype, start, count, monkeypatch):
    """Pages of whole blocks on Hopper through tensor descriptors (``use_tma`` with
    ``GPU_DESCRIPTORS`` on): the same values as pointer loads, so they must give the same
    bits, or a hit's suffix (the split launch reads by pointer) would differ from its
    recompute."""
    from kvtier.engine import paged_triton

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors need compute capability 9")
    kv_heads, n_rep, dim, page = 8, 4, 128, 64
    gen = torch.Generator(device="cuda").manual_seed(count)
    pages = -(-(start + count) // page) + 1
    k = torch.randn(pages, page, kv_heads, dim, device="cuda", generator=gen).to(dtype)
    v = torch.randn(pages, page, kv_heads, dim, device="cuda", generator=gen).to(dtype)
    table = torch.randperm(pages, device="cuda", generator=gen)[None].to(torch.int32)
    query = torch.randn(count, kv_heads * n_rep, dim, device="cuda", generator=gen).to(dtype)
    per = paged_triton.tokens_per_tile(n_rep)
    blocks = torch.as_tensor([(0, off, min(per, count - off), start + off)
                              for off in range(0, count, per)], dtype=torch.int32, device="cuda")
    launch = {"num_warps": paged_triton.NUM_WARPS, "num_stages": 3}   # one build a case
    monkeypatch.setattr(paged_triton, "GPU_DESCRIPTORS", True)
    monkeypatch.setattr(paged_triton, "_DESCRIPTORS_FAILED", None)
    assert paged_triton.use_tma(k, v)
    described = paged_triton.paged_attention(query, k, v, table, blocks, dim ** -0.5, per,
                                             launch=launch)
    # Built through descriptors, not fallen back to pointers (which would match trivially).
    assert paged_triton._DESCRIPTORS_FAILED is None
    monkeypatch.setattr(paged_triton, "use_tma", lambda *_: False)
    pointed = paged_triton.paged_attention(query, k, v, table, blocks, dim ** -0.5, per,
                                           launch=launch)
    assert torch.equal(described, pointed)
