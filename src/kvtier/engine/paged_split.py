"""Split-KV (flash-decoding) attention for decode rows over the device pool's pages, on CUDA.

Owns ``split_decode``. A decode row is one query token per sequence over its whole past; one
program per (sequence, KV head) would walk thousands of keys alone while most of the GPU idles.
Here the past is cut into fixed chunks of ``CHUNK_TOKENS`` key positions: one program per
(decode row, KV head, chunk) keeps an online softmax over its chunk (every query head sharing
the KV head, so grouped-query attention needs no copies) and stores its partial maximum, sum
and unnormalized output in fp32. A merge program per (decode row, query head) then combines the
chunks the row's length covers, in chunk order, one after another. The chunk size is a
constant and the merge order fixed, so a row's result depends only on its own keys: not on the
batch, the grid's width (chunks past a row's length are never read) or the other rows.

``decodes`` rows are (row of ``table``, query index, keys): everything a launch reads lives in
device tensors, so a CUDA graph replays the launch over static buffers. Tested on the CPU under
``TRITON_INTERPRET=1`` against the PyTorch path. Engine thread only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtier.engine.rounding import dot_at

#: Key positions one program reduces: a multiple of ``BLOCK_N``; 256 cuts a 5k-token past into
#: 20 programs per KV head, enough to fill the GPU for one sequence, while each chunk's partial
#: (a head_dim vector and two scalars in fp32) stays small next to the keys it read.
CHUNK_TOKENS = 256
BLOCK_N = 32
#: Software-pipelining stages of the chunk kernel: the same sums in the same order as Triton's
#: default 3 (bit-identical output), and on an H100 never slower: 2% faster at 64 rows of 5108
#: keys (where it reads K and V at 2.8 TB/s), 12% at 16 rows of 2049, even at 1 row
#: (benchmarks/results/decode_sweep_h100.*; ``benchmarks/engine/decode_sweep.py``).
NUM_STAGES = 2


@triton.jit(do_not_specialize=["max_pages", "n_splits"])
def split_decode_kernel(q_ptr, k_ptr, v_ptr, m_ptr, l_ptr, acc_ptr, table_ptr, decodes_ptr,
                        sq_t, sq_h, sk_tok, sk_h, max_pages, n_rep, page_size, scale_log2,
                        n_splits, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    """One decode row, one KV head, one chunk of keys: the chunk's partial softmax."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(decodes_ptr + row * 3)
    q_index = tl.load(decodes_ptr + row * 3 + 1)
    n_keys = tl.load(decodes_ptr + row * 3 + 2)
    rows = tl.arange(0, BLOCK_R)
    row_ok = rows < n_rep
    q_head = kv_head * n_rep + rows
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + q_index * sq_t + q_head[:, None] * sq_h + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    begin = split * CHUNK
    end = tl.minimum(begin + CHUNK, n_keys)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], tl.float32)
    for start in range(begin, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < end
        page = tl.load(table_ptr + seq * max_pages + cols // page_size, mask=col_ok, other=0)
        slot = page.to(tl.int64) * page_size + cols % page_size
        offsets = slot[:, None] * sk_tok + kv_head * sk_h + dims[None, :]
        k = tl.load(k_ptr + offsets, mask=col_ok[:, None], other=0.0)
        scores = dot_at(q, tl.trans(k), PRECISION) * scale_log2
        scores = tl.where(col_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + offsets, mask=col_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + dot_at(p.to(v.dtype), v, PRECISION)
        m_i = m_new
    part = (row * tl.num_programs(1) * n_rep + q_head) * n_splits + split
    tl.store(m_ptr + part, m_i, mask=row_ok)
    tl.store(l_ptr + part, l_i, mask=row_ok)
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["n_splits"])
def merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, decodes_ptr, n_splits,
                 HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr):
    """One decode row, one query head: its chunks combined in chunk order."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    heads = tl.num_programs(1)
    q_index = tl.load(decodes_ptr + row * 3 + 1)
    n_keys = tl.load(decodes_ptr + row * 3 + 2)
    used = (n_keys + CHUNK - 1) // CHUNK
    dims = tl.arange(0, HEAD_DIM)
    base = (row * heads + head) * n_splits
    m_run = tl.load(m_ptr + base)
    l_run = tl.load(l_ptr + base)
    acc = tl.load(acc_ptr + base * HEAD_DIM + dims)
    for s in range(1, used):
        m_s = tl.load(m_ptr + base + s)
        m_new = tl.maximum(m_run, m_s)
        alpha = tl.exp2(m_run - m_new)
        beta = tl.exp2(m_s - m_new)
        l_run = l_run * alpha + tl.load(l_ptr + base + s) * beta
        acc = acc * alpha + tl.load(acc_ptr + (base + s) * HEAD_DIM + dims) * beta
        m_run = m_new
    out = acc / l_run
    tl.store(out_ptr + (q_index * heads + head) * HEAD_DIM + dims,
             out.to(out_ptr.dtype.element_ty))


def splits_for(keys: int) -> int:
    """Chunks a past of ``keys`` positions is cut into."""
    return max(1, -(-keys // CHUNK_TOKENS))


def split_decode(query: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                 table: torch.Tensor, decodes: torch.Tensor, scaling: float, n_splits: int,
                 out: torch.Tensor) -> None:
    """Attend the decode rows of ``query`` (``[T, heads, dim]``) over their pages
    (``[pages, page_size, kv_heads, dim]``, contiguous) into ``out`` (``[T, heads, dim]``,
    contiguous; other rows untouched). ``decodes`` ``[rows, 3]`` int32 (row of ``table``,
    query index, keys); ``n_splits`` at least ``splits_for`` of the longest row."""
    heads, dim = query.shape[1], query.shape[2]
    kv_heads = key_pages.shape[2]
    if heads % kv_heads or dim & (dim - 1) or dim < 16:
        raise ValueError(f"split decode needs grouped heads and a power-of-two head_dim >= 16, "
                         f"got {heads} heads over {kv_heads}, head_dim {dim}")
    if not (key_pages.is_contiguous() and value_pages.is_contiguous() and out.is_contiguous()
            and query.stride(-1) == 1):
        raise ValueError("pages and out must be contiguous, queries contiguous in their last dim")
    n_rep, rows = heads // kv_heads, decodes.shape[0]
    if rows == 0:
        return
    partial = torch.empty((rows, heads, n_splits), dtype=torch.float32, device=query.device)
    sums = torch.empty_like(partial)
    acc = torch.empty((rows, heads, n_splits, dim), dtype=torch.float32, device=query.device)
    split_decode_kernel[(rows, kv_heads, n_splits)](
        query, key_pages, value_pages, partial, sums, acc, table, decodes,
        query.stride(0), query.stride(1), key_pages.stride(1), key_pages.stride(2),
        table.shape[1], n_rep, key_pages.shape[1], scaling * 1.4426950408889634, n_splits,
        HEAD_DIM=dim, BLOCK_R=max(16, triton.next_power_of_2(n_rep)), BLOCK_N=BLOCK_N,
        CHUNK=CHUNK_TOKENS, PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_stages=NUM_STAGES)
    merge_kernel[(rows, heads)](partial, sums, acc, out, decodes, n_splits,
                                HEAD_DIM=dim, CHUNK=CHUNK_TOKENS)
