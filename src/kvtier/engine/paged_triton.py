"""Paged attention on CUDA: a Triton kernel that reads keys and values in place in pool pages.

Owns ``paged_attention_kernel`` and ``TritonBatch`` (its launch for one step of
``kvtier.engine.paged.PagedBatch``). Decode rows (one new token) go to the split-KV kernels of
``kvtier.engine.paged_split``, which spread a long past over many programs; the rest (prefill
chunks) run here. Work is cut into query blocks: up to ``BLOCK_TOKENS``
consecutive new tokens of one sequence (one token for a decode). One program takes one query
block and one KV head, with the query rows of every query head that shares it (grouped-query
attention needs no copies), walks that sequence's page table ``BLOCK_N`` key positions at a
time (each position's page looked up in the table, so any page size works), applies the causal
mask (query at position ``p`` sees keys ``0 .. p``) and keeps an online softmax in fp32. The
sizes that change every step (tokens, blocks, table width) are not specialized on, so one
compile serves every batch. fp32 runs the dots in IEEE precision (no TF32), so a sequence's
greedy output does not depend on its batch. Tested on the CPU under ``TRITON_INTERPRET=1``
against the PyTorch path. Engine thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from kvtier.engine import paged_split
from kvtier.engine.rounding import dot_at

BLOCK_N = 32
#: Query rows (tokens x query heads per KV head) one program holds: always this many, so that
#: a query's dots run in one tile shape whatever its step holds.
MAX_ROWS = 64
#: Keys per chunk of the online softmax: a query's keys are summed in chunks from position 0,
#: each chunk from scratch, folded in order (``merge_chunk``), so that the split launch of
#: ``paged_split_prefill`` (one program per chunk) computes the same bits as this serial one.
CHUNK_TOKENS = 256


@triton.jit
def chunk_softmax(q, k_ptr, v_ptr, table_ptr, seq, max_pages, page_size, sk_tok, sk_h, kv_head,
                  chunk_start, chunk_end, last_visible, scale_log2,
                  HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Keys ``[chunk_start, chunk_end)`` of one sequence for ``BLOCK_R`` query rows (causal:
    a row sees keys up to its ``last_visible``): the chunk's running maximum, sum and
    unnormalized output in fp32. A row that sees none of them gets (-inf, 0, 0)."""
    dims = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], tl.float32)
    for start in range(chunk_start, chunk_end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < chunk_end
        page = tl.load(table_ptr + seq * max_pages + cols // page_size, mask=col_ok, other=0)
        slot = page.to(tl.int64) * page_size + cols % page_size
        offsets = slot[:, None] * sk_tok + kv_head * sk_h + dims[None, :]
        k = tl.load(k_ptr + offsets, mask=col_ok[:, None], other=0.0)
        scores = dot_at(q, tl.trans(k), PRECISION) * scale_log2
        visible = col_ok[None, :] & (cols[None, :] <= last_visible[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + offsets, mask=col_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + dot_at(p.to(v.dtype), v, PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def merge_chunk(m_run, l_run, acc_run, m_s, l_s, acc_s):
    """Fold one chunk's partial into the running one (chunks in key order). A chunk a row
    does not see (-inf, 0, 0) leaves the row's running values exactly as they were."""
    m_new = tl.maximum(m_run, m_s)
    alpha = tl.exp2(m_run - m_new)
    beta = tl.exp2(m_s - m_new)
    return m_new, l_run * alpha + l_s * beta, acc_run * alpha[:, None] + acc_s * beta[:, None]


@triton.jit(do_not_specialize=["max_pages"])
def paged_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, blocks_ptr,
                           sq_t, sq_h, sk_tok, sk_h, max_pages, n_rep, page_size, scale_log2,
                           HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    """One query block (row of ``blocks``: sequence, first query, queries, first position)
    and one KV head, its keys in ``CHUNK``-key chunks from position 0, folded in order."""
    block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(blocks_ptr + block * 4)
    q_first = tl.load(blocks_ptr + block * 4 + 1)
    q_count = tl.load(blocks_ptr + block * 4 + 2)
    pos_first = tl.load(blocks_ptr + block * 4 + 3)
    rows = tl.arange(0, BLOCK_R)
    token = rows // n_rep
    row_ok = token < q_count
    q_head = kv_head * n_rep + rows % n_rep
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q_first + token)[:, None] * sq_t + q_head[:, None] * sq_h
                + dims[None, :], mask=row_ok[:, None], other=0.0)
    last_visible = pos_first + token
    n_keys = pos_first + q_count
    m_run, l_run, acc_run = chunk_softmax(
        q, k_ptr, v_ptr, table_ptr, seq, max_pages, page_size, sk_tok, sk_h, kv_head, 0,
        tl.minimum(CHUNK, n_keys), last_visible, scale_log2, HEAD_DIM, BLOCK_R, BLOCK_N,
        PRECISION)
    for chunk_start in range(CHUNK, n_keys, CHUNK):
        m_s, l_s, acc_s = chunk_softmax(
            q, k_ptr, v_ptr, table_ptr, seq, max_pages, page_size, sk_tok, sk_h, kv_head,
            chunk_start, tl.minimum(chunk_start + CHUNK, n_keys), last_visible, scale_log2,
            HEAD_DIM, BLOCK_R, BLOCK_N, PRECISION)
        m_run, l_run, acc_run = merge_chunk(m_run, l_run, acc_run, m_s, l_s, acc_s)
    acc_run = acc_run / tl.where(l_run > 0.0, l_run, 1.0)[:, None]
    out_row = (q_first + token) * tl.num_programs(1) * n_rep + q_head  # out is [T, heads, dim]
    out_offsets = out_row[:, None] * HEAD_DIM + dims[None, :]
    tl.store(out_ptr + out_offsets, acc_run.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


class TritonBatch:
    """Page tables and query blocks of one step as device tensors (built once per step)."""

    def __init__(self, rows: Sequence[Any], q_starts: Sequence[int], page_size: int,
                 device: torch.device) -> None:
        self.rows, self.q_starts = list(rows), list(q_starts)
        self.page_size, self.device = page_size, device
        width = max(len(row.pages) for row in self.rows)
        table = torch.zeros((len(self.rows), width), dtype=torch.int32)
        for i, row in enumerate(self.rows):
            table[i, :len(row.pages)] = torch.as_tensor(list(row.pages), dtype=torch.int32)
        self.table = table.to(device)
        self._blocks: dict[int, tuple[torch.Tensor, int]] = {}
        decodes = [(i, first, row.end) for i, (row, first)
                   in enumerate(zip(self.rows, self.q_starts, strict=True)) if len(row.tokens) == 1]
        self.decodes = torch.as_tensor(decodes, dtype=torch.int32).reshape(-1, 3).to(device)
        self.n_splits = paged_split.splits_for(max((d[2] for d in decodes), default=1))

    @classmethod
    def build(cls, rows: Sequence[Any], q_starts: Sequence[int], page_size: int,
              device: torch.device) -> TritonBatch:
        return cls(rows, q_starts, page_size, device)

    def blocks(self, n_rep: int) -> tuple[torch.Tensor, int]:
        """``[blocks, 4]`` int32 (sequence, first query, queries, first position) and the
        most queries a block holds."""
        cached = self._blocks.get(n_rep)
        if cached is not None:
            return cached
        per_block = max(1, MAX_ROWS // n_rep)
        out = []
        for i, (row, first) in enumerate(zip(self.rows, self.q_starts, strict=True)):
            if len(row.tokens) == 1:
                continue   # a decode row: split-KV
            for offset in range(0, len(row.tokens), per_block):
                count = min(per_block, len(row.tokens) - offset)
                out.append((i, first + offset, count, row.start + offset))
        blocks = torch.as_tensor(out, dtype=torch.int32).reshape(-1, 4).to(self.device)
        self._blocks[n_rep] = blocks, max((block[2] for block in out), default=1)
        return self._blocks[n_rep]

    def attend(self, query: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """``query`` ``[T, heads, dim]`` over pages ``[pages, page_size, kv_heads, dim]``
        (contiguous); returns ``[T, heads, dim]``."""
        blocks, longest = self.blocks(query.shape[1] // key_pages.shape[2])
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if blocks.shape[0]:
            paged_attention(query, key_pages, value_pages, self.table, blocks, scaling, longest,
                            out)
        paged_split.split_decode(query, key_pages, value_pages, self.table, self.decodes,
                                 scaling, self.n_splits, out)
        return out


def paged_attention(query: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                    table: torch.Tensor, blocks: torch.Tensor, scaling: float,
                    longest: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the kernel: ``table`` ``[sequences, pages]`` int32, ``blocks`` as
    ``TritonBatch.blocks``, ``longest`` the most queries in one block; writes the blocks'
    rows of ``out`` (new when None) and returns it."""
    total, heads, dim = query.shape
    kv_heads = key_pages.shape[2]
    if heads % kv_heads or dim & (dim - 1) or dim < 16:
        raise ValueError(f"paged attention needs grouped heads and a power-of-two head_dim >= 16, "
                         f"got {heads} heads over {kv_heads}, head_dim {dim}")
    if not key_pages.is_contiguous() or not value_pages.is_contiguous() or query.stride(-1) != 1:
        raise ValueError("pages must be contiguous and queries contiguous in their last dim")
    n_rep = heads // kv_heads
    if longest * n_rep > MAX_ROWS and longest > 1:
        raise ValueError(f"a query block holds at most {MAX_ROWS} rows, got {longest} x {n_rep}")
    block_r = max(MAX_ROWS, triton.next_power_of_2(n_rep))
    if out is None:
        out = torch.empty((total, heads, dim), dtype=query.dtype, device=query.device)
    paged_attention_kernel[(blocks.shape[0], kv_heads)](
        query, key_pages, value_pages, out, table, blocks,
        query.stride(0), query.stride(1), key_pages.stride(1), key_pages.stride(2),
        table.shape[1], n_rep, key_pages.shape[1], scaling * 1.4426950408889634,
        HEAD_DIM=dim, BLOCK_R=block_r, BLOCK_N=BLOCK_N, CHUNK=CHUNK_TOKENS,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32")
    return out
