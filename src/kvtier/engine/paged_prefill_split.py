"""Split-KV prefill over the device pool's pages: a few query tokens over a long past, on CUDA.

Owns ``split_prefill`` and ``partials``. The flash kernel (``paged_triton``) gives one
program to each query tile and KV head, which walks the whole past alone: right for a long
prompt (many tiles), slow for a hit's few new tokens over tens of thousands of keys (a
handful of programs on 132 SMs). Here one program per (query tile, KV head, chunk) computes
one ``CHUNK_TOKENS``-key chunk with ``paged_tiles.chunk_softmax`` and stores its partial
(maximum, sum, unnormalized output, fp32); a second launch per (query tile, KV head) folds the
chunks in key order with ``paged_tiles.merge_chunk``, over the same rows in the same tile
shape. The flash kernel sums and folds the same chunks with the same helpers, so a query gets
the same bits either way: a hit's suffix computed here equals the same tokens computed by a
no-cache prefill (tested on the CPU in ``tests/test_paged_flash.py``, on the GPU in
``tests/test_suffix_step_gpu.py`` and ``tests/test_parity_gpu.py``).

``partials`` are sized for a step's query blocks and the most chunks a launch serves
(``[blocks, kv_heads, chunks, MAX_ROWS]`` and ``[..., head_dim]`` fp32): the captured suffix
steps hold one set for their largest split bucket. Engine thread only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtier.engine.paged_tiles import (
    BLOCK_N,
    CHUNK_TOKENS,
    MAX_ROWS,
    NUM_WARPS,
    check_chunk,
    chunk_softmax,
    merge_chunk,
    page_run,
    precision_for,
)


@triton.jit(do_not_specialize=["max_pages", "n_chunks"])
def split_prefill_kernel(q_ptr, k_ptr, v_ptr, m_ptr, l_ptr, acc_ptr, table_ptr, blocks_ptr,
                         sq_t, sq_h, sk_tok, sk_h, max_pages, n_rep, page_size, scale_log2,
                         n_chunks, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, PAGE_RUN: tl.constexpr,
                         PRECISION: tl.constexpr):
    """One query block, one KV head, one chunk of keys: the chunk's partial softmax."""
    block = tl.program_id(0)
    kv_head = tl.program_id(1)
    chunk = tl.program_id(2)
    seq = tl.load(blocks_ptr + block * 4)
    q_first = tl.load(blocks_ptr + block * 4 + 1)
    q_count = tl.load(blocks_ptr + block * 4 + 2)
    pos_first = tl.load(blocks_ptr + block * 4 + 3)
    n_keys = pos_first + q_count
    chunk_start = chunk * CHUNK
    if chunk_start < n_keys:
        rows = tl.arange(0, BLOCK_R)
        token = rows // n_rep
        row_ok = token < q_count
        q_head = kv_head * n_rep + rows % n_rep
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + (q_first + token)[:, None] * sq_t + q_head[:, None] * sq_h
                    + dims[None, :], mask=row_ok[:, None], other=0.0)
        m_s, l_s, acc_s = chunk_softmax(
            q, k_ptr, v_ptr, table_ptr, seq, max_pages, page_size, sk_tok, sk_h, kv_head,
            chunk_start, tl.minimum(chunk_start + CHUNK, n_keys), pos_first + token,
            scale_log2, HEAD_DIM, BLOCK_R, BLOCK_N, CHUNK // BLOCK_N, PAGE_RUN, PRECISION)
        part = ((block * tl.num_programs(1) + kv_head) * n_chunks + chunk) * BLOCK_R + rows
        tl.store(m_ptr + part, m_s)
        tl.store(l_ptr + part, l_s)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc_s)


@triton.jit(do_not_specialize=["n_chunks"])
def merge_prefill_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, blocks_ptr, n_rep, n_chunks, scale_log2,
                         HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr):
    """One query tile, one KV head: its chunks folded in key order, as the flash kernel."""
    block = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_first = tl.load(blocks_ptr + block * 4 + 1)
    q_count = tl.load(blocks_ptr + block * 4 + 2)
    n_keys = tl.load(blocks_ptr + block * 4 + 3) + q_count
    rows = tl.arange(0, BLOCK_R)
    token = rows // n_rep
    row_ok = token < q_count
    q_head = kv_head * n_rep + rows % n_rep
    dims = tl.arange(0, HEAD_DIM)
    base = (block * tl.num_programs(1) + kv_head) * n_chunks * BLOCK_R + rows
    m_run = tl.load(m_ptr + base)
    l_run = tl.load(l_ptr + base)
    acc_run = tl.load(acc_ptr + base[:, None] * HEAD_DIM + dims[None, :])
    for chunk in range(1, (n_keys + CHUNK - 1) // CHUNK):
        part = base + chunk * BLOCK_R
        m_run, l_run, acc_run = merge_chunk(
            m_run, l_run, acc_run, tl.load(m_ptr + part), tl.load(l_ptr + part),
            tl.load(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :]), scale_log2)
    acc_run = acc_run / tl.where(l_run > 0.0, l_run, 1.0)[:, None]
    out_row = (q_first + token) * tl.num_programs(1) * n_rep + q_head
    tl.store(out_ptr + out_row[:, None] * HEAD_DIM + dims[None, :],
             acc_run.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def partials(blocks: int, kv_heads: int, chunks: int, head_dim: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zeroed partial buffers for ``blocks`` query blocks over up to ``chunks`` chunks."""
    shape = (blocks, kv_heads, chunks, MAX_ROWS)
    return (torch.zeros(shape, dtype=torch.float32, device=device),
            torch.zeros(shape, dtype=torch.float32, device=device),
            torch.zeros((*shape, head_dim), dtype=torch.float32, device=device))


def split_prefill(query: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                  table: torch.Tensor, blocks: torch.Tensor, scaling: float, out: torch.Tensor,
                  parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor], *,
                  chunk: int = CHUNK_TOKENS) -> torch.Tensor:
    """The flash kernel's result for ``blocks`` (as ``paged_triton.paged_attention`` with the
    same ``chunk``), one program per chunk; ``parts`` from ``partials`` with at least
    ``blocks`` rows and as many chunks as the longest block's keys need."""
    heads, dim = query.shape[1], query.shape[2]
    kv_heads = key_pages.shape[2]
    n_rep = heads // kv_heads
    maxima, sums, outs = parts
    check_chunk(chunk)
    if n_rep > MAX_ROWS or blocks.shape[0] > maxima.shape[0] or maxima.shape[1] != kv_heads:
        raise ValueError(f"partials {tuple(maxima.shape)} do not fit {blocks.shape[0]} blocks "
                         f"of {kv_heads} KV heads")
    n_chunks = maxima.shape[2]
    grid = (blocks.shape[0], kv_heads)
    split_prefill_kernel[(*grid, n_chunks)](
        query, key_pages, value_pages, maxima, sums, outs, table, blocks,
        query.stride(0), query.stride(1), key_pages.stride(1), key_pages.stride(2),
        table.shape[1], n_rep, key_pages.shape[1], scaling * 1.4426950408889634, n_chunks,
        HEAD_DIM=dim, BLOCK_R=MAX_ROWS, BLOCK_N=BLOCK_N, CHUNK=chunk,
        PAGE_RUN=page_run(key_pages.shape[1]), PRECISION=precision_for(query.dtype),
        num_warps=NUM_WARPS)   # the flash kernel's warps: a row's sums laid out alike
    merge_prefill_kernel[grid](maxima, sums, outs, out, blocks, n_rep, n_chunks,
                               scaling * 1.4426950408889634, HEAD_DIM=dim, BLOCK_R=MAX_ROWS,
                               CHUNK=chunk)
    return out
