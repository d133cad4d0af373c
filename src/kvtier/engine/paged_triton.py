"""Paged prefill on CUDA: a flash-attention Triton kernel that reads keys and values in pool pages.

Owns ``flash_prefill_kernel``, its launch ``paged_attention`` and ``TritonBatch`` (the launch
for one step of ``kvtier.engine.paged.PagedBatch``). Decode rows (one new token) go to the
split-KV kernels of ``kvtier.engine.paged_split``, which spread a long past over many
programs; the rest (prompts, prompt chunks, a hit's suffix) run here.

Work is cut into tiles of ``MAX_ROWS`` query rows: up to ``MAX_ROWS // n_rep`` consecutive new
tokens of one sequence times the ``n_rep`` query heads sharing one KV head (grouped-query
attention packed into the tile, no copies). One program takes one tile and one KV head and
walks the sequence's keys from position 0 in blocks of ``BLOCK_N``: when pages hold whole
blocks, a chunk's pages are looked up in one vector load before its blocks (any page size
works, one lookup per key otherwise), and a block is read by pointers or through tensor
descriptors (``use_tma``);
blocks every row of the tile sees whole run without a mask, only the last few (the causal
diagonal) are masked, and blocks past the tile's last query are never read. The
softmax is online in fp32 with the dots in bf16/fp16 on the tensor cores, fp32 in IEEE
precision (no TF32).

The numerics contract (a hit's tokens are a recompute's): the sums over keys are
``kvtier.engine.paged_tiles``'s, chunks of ``CHUNK_TOKENS`` keys from position 0, each summed
from scratch block by block and folded in key order, the same for every query row whatever
its tile, the tile's size or how the prompt was split into steps. So a prompt computed whole,
in chunks and as a hit's suffix (here or in the split launch of ``paged_prefill_split``) gives
the same bits. ``num_warps``/``num_stages`` come from a small autotune keyed on head_dim and
dtype (``CONFIGS``: the pipeline depth, on a fixed 8 warps shared with the split launch).

The sizes that change every step (tokens, tiles, table width) are not specialized on, so one
compile serves every batch. Tested on the CPU under ``TRITON_INTERPRET=1`` against the PyTorch
path. Engine thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from kvtier.engine import paged_split
from kvtier.engine.paged_tiles import (
    BLOCK_N,
    CHUNK_TOKENS,
    MAX_ROWS,
    NUM_WARPS,
    attend_block,
    check_chunk,
    chunk_pages,
    load_block,
    merge_chunk,
    page_run,
    precision_for,
)
from kvtier.engine.rounding import INTERPRET

try:     # Triton 3.4+: Hopper's tensor-memory accelerator from host-built descriptors
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:   # an older Triton: pointer loads only
    TensorDescriptor = None

log = logging.getLogger(__name__)
#: Why the descriptor loads failed to build in this process (then pointer loads), or None.
_DESCRIPTORS_FAILED: str | None = None
#: Descriptor loads on GPUs (``use_tma``; keys, values and, with ``query_box``, queries). On
#: since they were shown on an H100 to give the pointer loads' bits
#: (``tests/test_suffix_step_gpu.py``'s descriptor cases; the split launch a hit's suffix takes
#: reads through pointers, and the GPU parity tests pass with them on) and to be faster: 22.9
#: against 25.0 ms a 32k layer (``benchmarks/results/attention_sweep_h100_qbox.txt``). The
#: interpreter runs them on the CPU either way.
GPU_DESCRIPTORS = True

__all__ = ["BLOCK_N", "CHUNK_TOKENS", "CONFIGS", "MAX_ROWS", "NUM_WARPS", "TritonBatch",
           "paged_attention",
           "tokens_per_tile"]

#: The autotune's candidates: software-pipeline depths (``num_stages``) 2, 3 and 4 on 8 warps.
#: Two or more stages of K/V blocks (32 KiB a stage in bf16 at head_dim 128) fit shared
#: memory beside the query tile; fp32 tiles double that, where the deeper configs fail to fit
#: and drop out; which depth wins depends on the GPU, so it is measured once per (head_dim,
#: dtype) and process, on the first launch. ``num_warps`` stays 8: a 128-row tile holds two
#: fp32 accumulators (the chunk's and the running one), 128 registers a thread on 8 warps at
#: head_dim 128 (ptxas for sm_90a: 255 registers, a few bytes of spills), where 4 warps spill
#: ~2.8 KB a thread; and the warps decide how a row's sums are laid out over threads, so the
#: split launch (``paged_prefill_split``, also 8 warps) could otherwise sum a row in another
#: order. A stage count changes only when loads are issued, never a sum's order.
CONFIGS = [triton.Config({}, num_warps=NUM_WARPS, num_stages=s) for s in (2, 3, 4)]


@triton.jit(do_not_specialize=["max_pages"])
def flash_prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, blocks_ptr,
                         sq_t, sq_h, sk_tok, sk_h, max_pages, n_rep, page_size, scale_log2,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         CHUNK: tl.constexpr, PER_CHUNK: tl.constexpr,
                         PAGE_RUN: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
                         Q_BOX: tl.constexpr = 0):
    """One tile (row of ``blocks``: sequence, first query, queries, first position) and one
    KV head: chunks of ``CHUNK`` keys (``PER_CHUNK`` blocks) from position 0, each summed from
    scratch and folded in order; masks only in the chunks the diagonal crosses. ``Q_BOX``
    (non-zero): ``q_ptr`` is a descriptor over ``[tokens, heads, HEAD_DIM]`` and a tile's
    queries come as one box of ``Q_BOX`` tokens x ``BLOCK_M // Q_BOX`` heads (the rows past
    the tile's own tokens are read and never stored)."""
    # the last tiles first: a causal prompt's later tiles read the most keys, and starting them
    # first keeps short ones for the end of the launch (no long tail on a few SMs)
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(blocks_ptr + tile * 4)
    q_first = tl.load(blocks_ptr + tile * 4 + 1)
    q_count = tl.load(blocks_ptr + tile * 4 + 2)
    pos_first = tl.load(blocks_ptr + tile * 4 + 3)
    rows = tl.arange(0, BLOCK_M)
    token = rows // n_rep
    row_ok = token < q_count
    q_head = kv_head * n_rep + rows % n_rep
    dims = tl.arange(0, HEAD_DIM)
    if Q_BOX:
        q = tl.reshape(q_ptr.load([q_first, kv_head * (BLOCK_M // Q_BOX), 0]),
                       [BLOCK_M, HEAD_DIM])
    else:
        q = tl.load(q_ptr + (q_first + token)[:, None] * sq_t + q_head[:, None] * sq_h
                    + dims[None, :], mask=row_ok[:, None], other=0.0)
    last_visible = pos_first + token
    n_keys = pos_first + q_count
    n_blocks = tl.cdiv(n_keys, BLOCK_N)
    n_full = (pos_first + 1) // BLOCK_N      # blocks every row of the tile sees whole
    m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_M], tl.float32)
    acc_run = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Chunks every row sees whole: a clean inner loop of unmasked blocks (software-pipelined,
    # the tensor-core products asynchronous), the fold between inner loops. A fold inside the
    # block loop would serialize the products (the chunk's accumulator read between them).
    for c in range(0, n_full // PER_CHUNK):
        m_c = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_c = tl.zeros([BLOCK_M], tl.float32)
        acc_c = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        pages = chunk_pages(table_ptr, seq, max_pages, page_size, c * CHUNK, BLOCK_N, PER_CHUNK,
                            PAGE_RUN)
        for start in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK_N):
            k, v = load_block(k_ptr, v_ptr, table_ptr, seq, max_pages, page_size, sk_tok, sk_h,
                              kv_head, start, n_keys, pages, (start - c * CHUNK) // BLOCK_N,
                              HEAD_DIM, BLOCK_N, PAGE_RUN, False, TMA)
            m_c, l_c, acc_c = attend_block(q, k, v, m_c, l_c, acc_c, start, n_keys,
                                           last_visible, scale_log2, BLOCK_N, False, PRECISION)
        m_run, l_run, acc_run = merge_chunk(m_run, l_run, acc_run, m_c, l_c, acc_c, scale_log2)
    # The chunk(s) the causal diagonal crosses: unmasked blocks first, then the masked ones.
    for c in range(n_full // PER_CHUNK, tl.cdiv(n_blocks, PER_CHUNK)):
        m_c = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_c = tl.zeros([BLOCK_M], tl.float32)
        acc_c = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        chunk_end = tl.minimum(c * CHUNK + CHUNK, n_keys)
        full_end = tl.minimum(chunk_end, n_full * BLOCK_N)
        pages = chunk_pages(table_ptr, seq, max_pages, page_size, c * CHUNK, BLOCK_N, PER_CHUNK,
                            PAGE_RUN)
        for start in range(c * CHUNK, full_end, BLOCK_N):
            k, v = load_block(k_ptr, v_ptr, table_ptr, seq, max_pages, page_size, sk_tok, sk_h,
                              kv_head, start, n_keys, pages, (start - c * CHUNK) // BLOCK_N,
                              HEAD_DIM, BLOCK_N, PAGE_RUN, False, TMA)
            m_c, l_c, acc_c = attend_block(q, k, v, m_c, l_c, acc_c, start, n_keys,
                                           last_visible, scale_log2, BLOCK_N, False, PRECISION)
        for start in range(tl.maximum(full_end, c * CHUNK), chunk_end, BLOCK_N):
            k, v = load_block(k_ptr, v_ptr, table_ptr, seq, max_pages, page_size, sk_tok, sk_h,
                              kv_head, start, n_keys, pages, (start - c * CHUNK) // BLOCK_N,
                              HEAD_DIM, BLOCK_N, PAGE_RUN, True, TMA)
            m_c, l_c, acc_c = attend_block(q, k, v, m_c, l_c, acc_c, start, n_keys,
                                           last_visible, scale_log2, BLOCK_N, True, PRECISION)
        m_run, l_run, acc_run = merge_chunk(m_run, l_run, acc_run, m_c, l_c, acc_c, scale_log2)
    acc_run = acc_run / tl.where(l_run > 0.0, l_run, 1.0)[:, None]
    out_row = (q_first + token) * tl.num_programs(1) * n_rep + q_head  # out is [T, heads, dim]
    out_offsets = out_row[:, None] * HEAD_DIM + dims[None, :]
    tl.store(out_ptr + out_offsets, acc_run.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


_tuned_kernel = triton.autotune(configs=CONFIGS, key=["HEAD_DIM"])(flash_prefill_kernel)


class TritonBatch:
    """Page tables and query tiles of one step as device tensors (built once per step)."""

    def __init__(self, rows: Sequence[Any], q_starts: Sequence[int], page_size: int,
                 device: torch.device, fa3: bool = False) -> None:
        self.rows, self.q_starts = list(rows), list(q_starts)
        self.page_size, self.device = page_size, device
        width = max(len(row.pages) for row in self.rows)
        table = torch.zeros((len(self.rows), width), dtype=torch.int32)
        for i, row in enumerate(self.rows):
            table[i, :len(row.pages)] = torch.as_tensor(list(row.pages), dtype=torch.int32)
        self.table = table.to(device)
        self._blocks: dict[int, tuple[torch.Tensor, int]] = {}
        decodes = [(i, first, row.end) for i, (row, first)
                   in enumerate(zip(self.rows, self.q_starts, strict=True)) if row.decode]
        self.decodes = torch.as_tensor(decodes, dtype=torch.int32).reshape(-1, 3).to(device)
        self.n_splits = paged_split.splits_for(max((d[2] for d in decodes), default=1))
        self.fa3 = None   # the prompt rows' FA3 plan (``paged_fa3_plan``), or None: this kernel
        if fa3:
            from kvtier.engine import paged_fa3_plan

            self.fa3 = paged_fa3_plan.plan_step(self.rows, self.q_starts, page_size, device)

    @classmethod
    def build(cls, rows: Sequence[Any], q_starts: Sequence[int], page_size: int,
              device: torch.device, fa3: bool = False) -> TritonBatch:
        return cls(rows, q_starts, page_size, device, fa3)

    def blocks(self, n_rep: int) -> tuple[torch.Tensor, int]:
        """``[tiles, 4]`` int32 (sequence, first query, queries, first position) and the
        most queries a tile holds."""
        cached = self._blocks.get(n_rep)
        if cached is not None:
            return cached
        per_block = tokens_per_tile(n_rep)
        out = []
        for i, (row, first) in enumerate(zip(self.rows, self.q_starts, strict=True)):
            if row.decode:
                continue   # split-KV
            for offset in range(0, len(row.tokens), per_block):
                count = min(per_block, len(row.tokens) - offset)
                out.append((i, first + offset, count, row.start + offset))
        blocks = torch.as_tensor(out, dtype=torch.int32).reshape(-1, 4).to(self.device)
        self._blocks[n_rep] = blocks, max((block[2] for block in out), default=1)
        return self._blocks[n_rep]

    def attend(self, query: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """``query`` ``[T, heads, dim]`` over pages ``[pages, page_size, kv_heads, dim]``
        (contiguous); returns ``[T, heads, dim]``. Prompt rows through FA3 where the batch
        was built for it (decode rows get zeros there, then the split-KV kernel's result)."""
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if self.fa3 is not None:
            if self.fa3.any:
                from kvtier.engine import paged_fa3

                paged_fa3.attend(query, key_pages, value_pages, self.fa3, scaling, out)
        else:
            blocks, longest = self.blocks(query.shape[1] // key_pages.shape[2])
            if blocks.shape[0]:
                paged_attention(query, key_pages, value_pages, self.table, blocks, scaling,
                                longest, out)
        paged_split.split_decode(query, key_pages, value_pages, self.table, self.decodes,
                                 scaling, self.n_splits, out)
        return out


def tokens_per_tile(n_rep: int) -> int:
    """New tokens one tile holds with ``n_rep`` query heads per KV head."""
    return max(1, MAX_ROWS // n_rep)


def paged_attention(query: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                    table: torch.Tensor, blocks: torch.Tensor, scaling: float,
                    longest: int, out: torch.Tensor | None = None, *,
                    chunk: int = CHUNK_TOKENS, block_n: int = BLOCK_N,
                    launch: dict[str, int] | None = None) -> torch.Tensor:
    """Launch the kernel: ``table`` ``[sequences, pages]`` int32, ``blocks`` as
    ``TritonBatch.blocks``, ``longest`` the most queries in one tile; writes the tiles'
    rows of ``out`` (new when None) and returns it. ``chunk`` (keys a chunk sums from
    scratch, a multiple of ``BLOCK_N``) is the engine's ``CHUNK_TOKENS``; tests take small
    ones to cross many chunk boundaries in few keys. ``block_n`` and ``launch`` (warps and
    stages in place of the autotune's) are for ``benchmarks/engine/attention_sweep.py``: the
    engine keeps ``BLOCK_N``, which the split launch shares."""
    total, heads, dim = query.shape
    kv_heads = key_pages.shape[2]
    if heads % kv_heads or dim & (dim - 1) or dim < 16:
        raise ValueError(f"paged attention needs grouped heads and a power-of-two head_dim >= 16, "
                         f"got {heads} heads over {kv_heads}, head_dim {dim}")
    if not key_pages.is_contiguous() or not value_pages.is_contiguous() or query.stride(-1) != 1:
        raise ValueError("pages must be contiguous and queries contiguous in their last dim")
    n_rep = heads // kv_heads
    check_chunk(chunk, block_n)
    if n_rep > MAX_ROWS or longest > tokens_per_tile(n_rep):
        raise ValueError(f"a query tile holds at most {MAX_ROWS} rows, got {longest} x {n_rep}")
    if out is None:
        out = torch.empty((total, heads, dim), dtype=query.dtype, device=query.device)
    tma = use_tma(key_pages, value_pages, block_n)
    keys, values = (page_descriptor(key_pages, block_n), page_descriptor(value_pages, block_n)) \
        if tma else (key_pages, value_pages)
    q_box = query_box(query, n_rep) if tma else 0
    queries = TensorDescriptor.from_tensor(query, [q_box, n_rep, dim]) if q_box else query
    args = (queries, keys, values, out, table, blocks,
            query.stride(0), query.stride(1), key_pages.stride(1), key_pages.stride(2),
            table.shape[1], n_rep, key_pages.shape[1], scaling * 1.4426950408889634)
    constants = dict(HEAD_DIM=dim, BLOCK_M=MAX_ROWS, BLOCK_N=block_n,
                     CHUNK=chunk, PER_CHUNK=chunk // block_n,
                     PAGE_RUN=page_run(key_pages.shape[1], block_n),
                     PRECISION=precision_for(query.dtype), TMA=tma, Q_BOX=q_box)
    grid = (blocks.shape[0], kv_heads)
    try:
        if launch is not None:
            flash_prefill_kernel[grid](*args, **constants, **launch)
        elif INTERPRET:   # no timing on the CPU: one config
            flash_prefill_kernel[grid](*args, **constants, num_warps=NUM_WARPS)
        else:
            _tuned_kernel[grid](*args, **constants)
    except Exception as exc:
        if not tma:
            raise
        # A Triton that cannot build the descriptor loads here: pointer loads from now on
        # (the same values), said once.
        global _DESCRIPTORS_FAILED
        cause = exc.__cause__ or exc.__context__
        why = f"{type(exc).__name__}: {_last_words(str(exc))}"
        _DESCRIPTORS_FAILED = why if cause is None else \
            f"{why}; caused by {type(cause).__name__}: {_last_words(str(cause))}"
        log.warning("paged prefill: tensor-descriptor loads failed to build (%s); reading "
                    "pages through pointers", _DESCRIPTORS_FAILED)
        return paged_attention(query, key_pages, value_pages, table, blocks, scaling, longest,
                               out, chunk=chunk, block_n=block_n, launch=launch)
    return out


def _last_words(message: str, limit: int = 400) -> str:
    """The end of a compiler's message, on one line: the reason follows the code it quotes."""
    flat = " ".join(message.split())
    return flat if len(flat) <= limit else "..." + flat[-limit:]


def use_tma(key_pages: torch.Tensor, value_pages: torch.Tensor, block_n: int = BLOCK_N) -> bool:
    """Whether the flash kernel reads key blocks through tensor descriptors: pages holding
    whole blocks, in the interpreter (which checks the code on the CPU) or, with
    ``GPU_DESCRIPTORS``, on a GPU with a tensor-memory accelerator (compute capability 9 or
    later). The values are the pointer loads' (the sums do not change); on an H100 a plain
    flash kernel ran 0.66x flash SDPA's time with them against 0.74x without
    (``benchmarks/results/attention_ceiling_h100.txt``)."""
    if not page_run(key_pages.shape[1], block_n) or TensorDescriptor is None \
            or _DESCRIPTORS_FAILED:
        return False
    if INTERPRET:
        return True
    return (GPU_DESCRIPTORS and key_pages.is_cuda and value_pages.is_cuda
            and torch.cuda.get_device_capability(key_pages.device)[0] >= 9)


def query_box(query: torch.Tensor, n_rep: int) -> int:
    """Tokens per tile when a tile's queries come through a tensor descriptor, else 0 (pointer
    loads). With descriptors they stay in shared memory, where the tensor cores read them,
    instead of 32 registers a thread: on sm_90 (Triton 3.6's ptxas) the kernel then holds both
    fp32 accumulators (the chunk's and the running one) in 238 registers without spilling,
    against 255 and ~400 bytes of spills a thread with pointer-loaded queries. A box has
    power-of-two sides, so ``n_rep`` must be a power of two (a tile is then exactly
    ``MAX_ROWS`` rows); TMA also needs 16-byte-aligned rows."""
    size = query.element_size()
    if n_rep & (n_rep - 1) or n_rep > MAX_ROWS or query.data_ptr() % 16 \
            or any(stride * size % 16 for stride in query.stride()[:-1]):
        return 0
    return MAX_ROWS // n_rep


def page_descriptor(pages: torch.Tensor, block_n: int = BLOCK_N) -> Any:
    """A tensor descriptor over ``[pages, page_size, kv_heads, dim]`` (contiguous) as rows
    of ``kv_heads * dim``, boxes of one block of one head."""
    dim = pages.shape[3]
    return TensorDescriptor.from_tensor(pages.view(-1, pages.shape[2] * dim), [block_n, dim])
