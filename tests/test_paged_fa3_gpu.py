"""FlashAttention 3 over the device pool on a Hopper GPU (skipped where vLLM's FA3 is missing):
a prompt past several key cuts (``paged_fa3_plan``) gives the same bits whole, in steps of any
size and as a hit's suffix of any length, alone or beside decode rows and other prompts, in a
replayed CUDA graph too, close to one unsplit launch; and a served hit through it gives the
greedy tokens of a no-cache run."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine import paged, paged_fa3, paged_fa3_plan, paged_triton
from kvtier.engine.request import GenerationRequest
from kvtier.engine.service import EngineService
from test_deterministic import _tokens, deterministic_lm
from test_engine_support import make_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available()
                                 or paged_fa3.kernel() is None, reason="no FA3 here")]


def _pool(total: int, page: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-total // page) + 3
    k = torch.randn(pages, page, kv_heads, dim, device="cuda", generator=gen).to(dtype)
    v = torch.randn(pages, page, kv_heads, dim, device="cuda", generator=gen).to(dtype)
    table = torch.randperm(pages, device="cuda", generator=gen)[None].to(torch.int32)
    return k, v, table, gen


def _attend(query, k, v, pages, start: int, count: int) -> torch.Tensor:
    """Tokens ``start .. start + count`` of a prompt as one row of an eager step."""
    batch = paged_triton.TritonBatch([paged.BatchRow(pages, start, [0] * count, prompt=True)], [0],
                                     int(k.shape[1]), torch.device("cuda"), fa3=True)
    return batch.attend(query[start:start + count].contiguous(), k, v, query.shape[2] ** -0.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads,n_rep,dim,page", [(8, 4, 128, 64), (4, 7, 128, 16),
                                                     (8, 4, 128, 256)])
def test_a_prompt_whole_in_steps_and_as_a_suffix_gives_the_same_bits(dtype, kv_heads, n_rep,
                                                                       dim, page):
    total, cut = 20000, paged_fa3_plan.segment_for(page)     # two cuts: 8192, 16384
    k, v, table, gen = _pool(total, page, kv_heads, dim, dtype, page + n_rep)
    query = torch.randn(total, kv_heads * n_rep, dim, device="cuda", generator=gen).to(dtype)
    pages = table[0].tolist()
    whole = _attend(query, k, v, pages, 0, total)
    for size in (16384, 4096, 5000, 777):
        steps = torch.cat([_attend(query, k, v, pages, s, min(size, total - s))
                           for s in range(0, total, size)])
        assert torch.equal(steps, whole), size
    for end in (total, 2 * cut + 1, cut + 5, 5000):
        for new in (1, 8, 17, 77, 128):
            assert torch.equal(_attend(query, k, v, pages, end - new, new),
                               whole[end - new:end]), (end, new)
    # the cuts move sums, not results: one unsplit FA3 launch over all keys agrees
    unsplit = paged_fa3.launch(query, k, v, paged_fa3_plan.Launch(
        torch.tensor([0, total], dtype=torch.int32, device="cuda"),
        torch.tensor([total], dtype=torch.int32, device="cuda"), table, total), total, True,
        dim ** -0.5)[0]
    assert (unsplit.float() - whole.float()).abs().max() <= 0.02 * unsplit.float().abs().max()


def test_prompt_rows_beside_decodes_and_other_prompts_keep_their_bits():
    page, kv_heads, n_rep, dim = 64, 8, 4, 128
    k, v, table, gen = _pool(18000, page, kv_heads, dim, torch.bfloat16, 5)
    width = table.shape[1]
    pages = table[0].tolist()
    rows = [paged.BatchRow(pages, 3000, [1] * 900),      # a chunk after a past
            paged.BatchRow(pages, 4999, [1]),            # a decode
            paged.BatchRow(pages, 7900, [1] * 2000),     # a chunk across the first cut
            paged.BatchRow(pages, 17900, [1] * 17)]      # a hit's suffix, two cuts behind
    starts = [0, 900, 901, 2901]
    query = torch.randn(2918, kv_heads * n_rep, dim, device="cuda", generator=gen
                        ).to(torch.bfloat16)
    batch = paged_triton.TritonBatch(rows, starts, page, torch.device("cuda"), fa3=True)
    assert batch.table.shape == (4, width)
    out = batch.attend(query, k, v, dim ** -0.5)
    for row, first in zip(rows, starts, strict=True):
        if len(row.tokens) == 1:
            continue
        alone = paged_triton.TritonBatch([row], [0], page, torch.device("cuda"), fa3=True)
        n = len(row.tokens)
        assert torch.equal(out[first:first + n], alone.attend(query[first:first + n], k, v,
                                                               dim ** -0.5))


def test_a_captured_suffix_plan_replays_the_eager_bits_at_any_length():
    page, kv_heads, n_rep, dim, new, bucket = 64, 8, 4, 128, 17, 32
    k, v, table, gen = _pool(20000, page, kv_heads, dim, torch.bfloat16, 9)
    query = torch.randn(20000, kv_heads * n_rep, dim, device="cuda", generator=gen
                        ).to(torch.bfloat16)
    pages = table[0].tolist()
    capacity = table.shape[1] * page
    static = paged_fa3_plan.StaticPlan(bucket, capacity, page, torch.device("cuda"))
    q = torch.zeros((bucket, kv_heads * n_rep, dim), dtype=torch.bfloat16, device="cuda")
    out = torch.zeros_like(q)

    def launch() -> None:
        paged_fa3.attend(q, k, v, static.plan, dim ** -0.5, out)

    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    cut = paged_fa3_plan.segment_for(page)
    for end in (20000, 12345, 2 * cut + 3, cut + 9, 300, new):
        row = paged.BatchRow(pages, end - new, [0] * new, prompt=True)
        q[:new].copy_(query[end - new:end])
        static.fill(row)
        graph.replay()
        assert torch.equal(out[:new], _attend(query, k, v, pages, end - new, new)), end


def test_head_dims_whose_bits_move_keep_the_triton_kernels():
    """At head_dim 64 FA3 gave a prompt's last rows other bits as a suffix than whole (an H100,
    vLLM 0.26's build): such models keep the Triton kernels, whose sums never move."""
    lm = deterministic_lm("llama", "bfloat16", device="cuda", deterministic=False)
    assert lm.head_dim == 64 and paged.backend_of(lm) == "triton"


@pytest.mark.parametrize("arch", ["mistral"])      # head_dim 128
def test_served_hits_through_fa3_give_the_no_cache_tokens(arch, monkeypatch):
    monkeypatch.setattr(paged_fa3_plan, "SEGMENT_TOKENS", 256)   # 600-token prompts: two cuts
    lm = deterministic_lm(arch, "bfloat16", device="cuda", deterministic=False)
    assert paged.backend_of(lm) == "fa3"
    prompts = [_tokens(600, seed) for seed in range(4)]
    services = {}
    for cache in (False, True):
        config = make_config(**{"engine.device": "cuda", "engine.dtype": "bfloat16",
                                "cache.page_size": 64, "cache.device_pages": 256,
                                "cache.enabled": str(cache).lower(),
                                "host.pool_bytes": "32MiB" if cache else "0"})
        services[cache] = EngineService.build(config, lm=lm, max_running=4)
    try:
        for seed, prompt in enumerate(prompts):
            want = services[False].generate(GenerationRequest(tuple(prompt), 16), timeout=300)[0]
            cached = services[True]
            cached.generate(GenerationRequest(tuple(prompt[:100 + 60 * seed]) + (7,), 1),
                            timeout=300)
            for run in ("a hit on the head", "a hit on all but the last page"):
                got = cached.generate(GenerationRequest(tuple(prompt), 16), timeout=300)[0]
                assert got == want, (seed, run)
        assert services[True].engine.stats()["suffix_graph_steps"] >= len(prompts)
    finally:
        for service in services.values():
            service.close()
