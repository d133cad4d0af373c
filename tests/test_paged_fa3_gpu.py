"""FlashAttention 3 over the device pool on a Hopper GPU (skipped where vLLM's FA3 is missing):
a prompt gives the same bits whole, in steps of any size and as a hit's suffix of any length,
alone or beside decode rows and other prompts, in a replayed CUDA graph too; and a served hit
through it gives the greedy tokens of a no-cache run."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine import paged, paged_fa3, paged_triton
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads,n_rep,dim,page", [(8, 4, 128, 64), (4, 7, 128, 16),
                                                     (8, 4, 128, 256)])
def test_a_prompt_whole_in_steps_and_as_a_suffix_gives_the_same_bits(dtype, kv_heads, n_rep,
                                                                       dim, page):
    total = 9000
    k, v, table, gen = _pool(total, page, kv_heads, dim, dtype, page + n_rep)
    query = torch.randn(total, kv_heads * n_rep, dim, device="cuda", generator=gen).to(dtype)

    def run(start: int, count: int) -> torch.Tensor:
        cu = torch.tensor([0, count], dtype=torch.int32, device="cuda")
        used = torch.tensor([start + count], dtype=torch.int32, device="cuda")
        out = torch.empty((count, kv_heads * n_rep, dim), dtype=dtype, device="cuda")
        return paged_fa3.attend(query[start:start + count], k, v, table, cu, used, count,
                                start + count, dim ** -0.5, out)

    whole = run(0, total)
    for size in (4096, 2048, 1000, 77):
        steps = torch.cat([run(s, min(size, total - s)) for s in range(0, total, size)])
        assert torch.equal(steps, whole), size
    for past in (0, 4096, total - 128, total - 33, total - 8, total - 1, 5000 - 9):
        end = total if past >= 5000 else 5000
        assert torch.equal(run(past, end - past), whole[past:end]), past


def test_prompt_rows_beside_decodes_and_other_prompts_keep_their_bits():
    page, kv_heads, n_rep, dim = 64, 8, 4, 128
    k, v, table, gen = _pool(6000, page, kv_heads, dim, torch.bfloat16, 5)
    width = table.shape[1]
    rows = [paged.BatchRow(table[0].tolist(), 3000, [1] * 900),      # a chunk after a past
            paged.BatchRow(table[0].tolist(), 4999, [1]),            # a decode
            paged.BatchRow(table[0].tolist(), 0, [1] * 2000),        # a prompt
            paged.BatchRow(table[0].tolist(), 5900, [1] * 17)]       # a hit's suffix
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


def test_a_captured_launch_replays_the_eager_bits_at_any_length():
    page, kv_heads, n_rep, dim, new = 64, 8, 4, 128, 17
    k, v, table, gen = _pool(20000, page, kv_heads, dim, torch.bfloat16, 9)
    query = torch.randn(20000, kv_heads * n_rep, dim, device="cuda", generator=gen
                        ).to(torch.bfloat16)
    capacity = table.shape[1] * page
    q = torch.zeros((32, kv_heads * n_rep, dim), dtype=torch.bfloat16, device="cuda")
    out = torch.zeros_like(q)
    cu = torch.tensor([0, new], dtype=torch.int32, device="cuda")
    used = torch.tensor([new], dtype=torch.int32, device="cuda")

    def launch() -> None:
        paged_fa3.attend(q, k, v, table, cu, used, 32, capacity, dim ** -0.5, out)

    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for end in (20000, 12345, 300, new):
        q[:new].copy_(query[end - new:end])
        used.fill_(end)
        graph.replay()
        eager = paged_fa3.attend(query[end - new:end].contiguous(), k, v, table, cu,
                                 used.clone(), new, end, dim ** -0.5,
                                 torch.empty_like(out[:new]))
        assert torch.equal(out[:new], eager), end


def test_head_dims_whose_bits_move_keep_the_triton_kernels():
    """At head_dim 64 FA3 gave a prompt's last rows other bits as a suffix than whole (an H100,
    vLLM 0.26's build): such models keep the Triton kernels, whose sums never move."""
    lm = deterministic_lm("llama", "bfloat16", device="cuda", deterministic=False)
    assert lm.head_dim == 64 and paged.backend_of(lm) == "triton"


@pytest.mark.parametrize("arch", ["mistral"])      # head_dim 128
def test_served_hits_through_fa3_give_the_no_cache_tokens(arch):
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
