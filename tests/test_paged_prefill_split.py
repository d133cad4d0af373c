"""The paged prefill kernels (under TRITON_INTERPRET=1 on the CPU, bit-exact on the GPU in
``tests/test_parity_gpu.py``): the split launch gives the flash kernel's bits for queries
over pasts on and off the chunk size, and the flash kernel's chunked sum still equals plain
attention; a query's result does not depend on the block it sits in."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

paged_triton = pytest.importorskip("kvtier.engine.paged_triton")
from kvtier.engine import paged_prefill_split  # noqa: E402

PAGE, KV_HEADS, N_REP, DIM = 16, 2, 4, 16
CHUNK = 2 * paged_triton.BLOCK_N   # small chunks: many boundaries in few keys


def _pages(tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    pages = -(-tokens // PAGE) + 2
    k = torch.randn(pages, PAGE, KV_HEADS, DIM, generator=gen)
    v = torch.randn(pages, PAGE, KV_HEADS, DIM, generator=gen)
    table = torch.randperm(pages, generator=gen)[None].to(torch.int32)
    return k, v, table


def _blocks(start: int, count: int, per_block: int) -> torch.Tensor:
    rows = [(0, off, min(per_block, count - off), start + off)
            for off in range(0, count, per_block)]
    return torch.as_tensor(rows, dtype=torch.int32)


def _reference(query, k, v, table, start):
    count = query.shape[0]
    slots = (table[0].long()[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)[:start + count]
    keys = k.reshape(-1, KV_HEADS, DIM)[slots].transpose(0, 1)
    values = v.reshape(-1, KV_HEADS, DIM)[slots].transpose(0, 1)
    visible = torch.arange(start + count)[None, :] <= torch.arange(start, start + count)[:, None]
    out = F.scaled_dot_product_attention(query.transpose(0, 1), keys, values,
                                         attn_mask=visible, scale=0.25, enable_gqa=True)
    return out.transpose(0, 1)


@pytest.mark.parametrize("start,count", [(0, 20), (CHUNK - 3, 5), (CHUNK, 1), (2 * CHUNK + 7, 19)])
def test_the_split_launch_gives_the_serial_kernels_bits(start, count):
    k, v, table = _pages(start + count)
    query = torch.randn(count, KV_HEADS * N_REP, DIM, generator=torch.Generator().manual_seed(3))
    blocks = _blocks(start, count, paged_triton.MAX_ROWS // N_REP)
    serial = paged_triton.paged_attention(query, k, v, table, blocks, 0.25, int(blocks[0, 2]),
                                          chunk=CHUNK)
    chunks = -(-(start + count) // CHUNK) + 1
    parts = paged_prefill_split.partials(blocks.shape[0] + 1, KV_HEADS, chunks, DIM, query.device)
    split = paged_prefill_split.split_prefill(query, k, v, table, blocks, 0.25,
                                              torch.full_like(query, float("nan")), parts,
                                              chunk=CHUNK)
    assert torch.equal(split, serial)
    torch.testing.assert_close(serial, _reference(query, k, v, table, start), rtol=1e-5,
                               atol=1e-5)


def test_a_query_gets_the_same_bits_in_any_block():
    start, count = CHUNK + 9, 24
    k, v, table = _pages(start + count, seed=4)
    query = torch.randn(count, KV_HEADS * N_REP, DIM, generator=torch.Generator().manual_seed(5))
    results = []
    for per_block in (16, 5, 1):
        blocks = _blocks(start, count, per_block)
        results.append(paged_triton.paged_attention(query, k, v, table, blocks, 0.25, per_block,
                                                    chunk=CHUNK))
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_partials_that_do_not_fit_are_refused():
    k, v, table = _pages(40)
    query = torch.randn(8, KV_HEADS * N_REP, DIM)
    parts = paged_prefill_split.partials(1, KV_HEADS + 1, 2, DIM, query.device)
    with pytest.raises(ValueError, match="do not fit"):
        paged_prefill_split.split_prefill(query, k, v, table, _blocks(30, 8, 16), 0.25,
                                          torch.empty_like(query), parts)
