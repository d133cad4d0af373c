"""The split-KV decode kernels (run under TRITON_INTERPRET=1 on the CPU) against plain PyTorch
attention over the same pages: dtypes, page sizes, grouped-query ratios, ragged lengths, a
single page, lengths on and off the chunk size; and a row's result does not depend on its batch
or on how many chunks the launch spans."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtier.engine import paged_split


def _case(lengths, page, kv_heads, n_rep, dtype, dim=16, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-n // page) for n in lengths]
    pages = sum(widths) + 3
    k = torch.randn(pages, page, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(pages, page, kv_heads, dim, generator=gen).to(dtype)
    order = torch.randperm(pages, generator=gen).tolist()
    table = torch.zeros(len(lengths), max(widths) + 2, dtype=torch.int32)
    used = 0
    for i, w in enumerate(widths):
        table[i, :w] = torch.as_tensor(order[used:used + w])
        used += w
    # queries interleaved with rows that are not decodes: query index 2 * i
    query = torch.randn(2 * len(lengths), kv_heads * n_rep, dim, generator=gen).to(dtype)
    decodes = torch.as_tensor([(i, 2 * i, n) for i, n in enumerate(lengths)], dtype=torch.int32)
    return tuple(t.to(device) for t in (query, k, v, table, decodes))


def _reference(query, k, v, table, decodes, scale):
    page = k.shape[1]
    out = {}
    for seq, q_index, n in decodes.tolist():
        slots = (table[seq].long()[:, None] * page
                 + torch.arange(page, device=k.device)).reshape(-1)[:n]
        keys = k.reshape(-1, *k.shape[2:])[slots].float().transpose(0, 1)   # [kv, n, dim]
        values = v.reshape(-1, *v.shape[2:])[slots].float().transpose(0, 1)
        q = query[q_index].float()[:, None]                                  # [heads, 1, dim]
        out[q_index] = F.scaled_dot_product_attention(q, keys, values, scale=scale,
                                                      enable_gqa=True)[:, 0]
    return out


def _run(query, k, v, table, decodes, n_splits=None):
    out = torch.full(query.shape, float("nan"), dtype=query.dtype, device=query.device)
    longest = int(decodes[:, 2].max())
    paged_split.split_decode(query, k, v, table, decodes, 0.25,
                             n_splits or paged_split.splits_for(longest), out)
    return out


CHUNK = paged_split.CHUNK_TOKENS


def _half_dtypes():
    """bf16 where a GPU runs the kernels; the CPU interpreter's bf16 dot is wrong, fp16 stands in
    for the 16-bit path there (same kernel code: 16-bit loads, fp32 partials)."""
    return [(torch.bfloat16, 2e-2)] if torch.cuda.is_available() else [(torch.float16, 5e-3)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), *_half_dtypes()])
@pytest.mark.parametrize("page,kv_heads,n_rep", [(16, 2, 4), (64, 1, 8), (7, 2, 1), (32, 4, 2)])
def test_split_decode_matches_plain_attention(dtype, tol, page, kv_heads, n_rep):
    lengths = [1, page, CHUNK, CHUNK + 1, 2 * CHUNK + 37, 45]   # ragged; on and off the chunk
    query, k, v, table, decodes = _case(lengths, page, kv_heads, n_rep, dtype)
    out = _run(query, k, v, table, decodes)
    for q_index, want in _reference(query, k, v, table, decodes, 0.25).items():
        torch.testing.assert_close(out[q_index].float(), want, rtol=tol, atol=tol)
    untouched = [i for i in range(query.shape[0]) if i % 2]
    assert torch.isnan(out[untouched].float()).all()   # rows that are not decodes stay as given


def test_a_single_page_holding_the_whole_past():
    query, k, v, table, decodes = _case([5], 8, 2, 2, torch.float32)
    out = _run(query, k, v, table, decodes)
    want = _reference(query, k, v, table, decodes, 0.25)[0]
    torch.testing.assert_close(out[0], want, rtol=1e-5, atol=1e-5)


def test_a_rows_result_depends_on_neither_its_batch_nor_the_launch_width():
    lengths = [CHUNK + 9, 3 * CHUNK - 1, 20]
    query, k, v, table, decodes = _case(lengths, 16, 2, 4, torch.float32, seed=3)
    together = _run(query, k, v, table, decodes)
    wide = _run(query, k, v, table, decodes, n_splits=8)   # chunks past every row: never read
    assert torch.equal(wide[decodes[:, 1].long()], together[decodes[:, 1].long()])
    for i in range(len(lengths)):
        alone = _run(query, k, v, table, decodes[i:i + 1])
        q_index = int(decodes[i, 1])
        assert torch.equal(alone[q_index], together[q_index])


def test_shapes_the_kernel_cannot_serve_are_refused():
    query, k, v, table, decodes = _case([9], 8, 3, 1, torch.float32)
    with pytest.raises(ValueError, match="grouped heads"):
        paged_split.split_decode(query[:, :2], k, v, table, decodes, 0.25, 1,
                                 torch.empty_like(query[:, :2]))
