"""The arithmetic every paged prefill kernel shares: one key block, one key chunk, one fold.

Owns the constants and ``@triton.jit`` helpers that fix how a query's attention over its
keys is summed, whichever launch computes it (``paged_triton``'s flash kernel for prompts
and chunks, ``paged_prefill_split``'s split launch for a hit's few new tokens):

- keys are read in blocks of ``BLOCK_N`` positions aligned on position 0 (``load_block``:
  when pages hold whole blocks, a chunk's pages come in one vector load before its blocks,
  ``chunk_pages``; one lookup per key otherwise; with
  ``TMA`` the block comes through Hopper's tensor-memory accelerator from a tensor
  descriptor over the pages, the same values, no address tiles in registers);
- a block updates a chunk's online softmax (``attend_block``): the scores stay unscaled
  until they are shifted by the running maximum, ``exp2((s - m) * scale)``, so no step
  can be contracted into a fused multiply-add on one path and not on another; the masked
  form (``MASKED``) adds only selects that are identities for keys a row sees, so a block
  gives the same bits whether a tile needed its mask or not, and a block a row sees none
  of leaves the row's values exactly as they were (``alpha`` 1, ``p`` 0);
- keys are summed in chunks of ``CHUNK_TOKENS`` positions from position 0, each from
  scratch (``chunk_softmax``), folded into the running result in key order
  (``merge_chunk``).

A query's result therefore depends only on its own keys: not on which tile it sits in, how
many queries the tile holds, which blocks the tile skipped or masked, or whether its chunks
ran in one program or many. Called from kernels on whatever thread launches them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvtier.engine.rounding import dot_acc, dot_at

#: Keys per block: 64 keys feed the tensor cores a 64-deep product for P @ V and keep a
#: block's K and V tiles (2 x 64 x 128 bf16 = 32 KiB) small enough for three stages of
#: software pipelining in an H100's 228 KiB of shared memory beside 128 query rows.
BLOCK_N = 64
#: Keys per chunk of the online softmax (a multiple of ``BLOCK_N``): the unit the split
#: launch gives one program, and the flash kernel's inner loop (its software pipeline
#: restarts at every chunk: each restart waits one block's load with nothing to overlap).
#: 1024 keys (16 blocks) keep that wait a few percent of a chunk's products, and still cut a
#: 32k past into 32 split programs per KV head (256 for an 8-KV-head model on 132 SMs).
CHUNK_TOKENS = 1024
#: Query rows (tokens x query heads per KV head) a tile holds: the flash kernel's BLOCK_M.
#: 128 rows (32 tokens x a group of 4 query heads, as in 8B models) is the tile flash attention
#: runs on Hopper for head_dim 128; the split launch and the captured suffix steps use the same.
MAX_ROWS = 128
#: Warps of every launch that computes a tile's rows (see ``paged_triton.CONFIGS``).
NUM_WARPS = 8


@triton.jit
def load_block(k_ptr, v_ptr, table_ptr, seq, max_pages, page_size, sk_tok, sk_h, kv_head,
               start, end, pages, block, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
               PAGE_RUN: tl.constexpr, CHECK_END: tl.constexpr, TMA: tl.constexpr = False):
    """Keys and values ``[start, start + BLOCK_N)`` of one sequence (positions at or past
    ``end`` read as zeros; ``CHECK_END`` False: the caller knows the block ends before
    ``end``) as ``[BLOCK_N, HEAD_DIM]`` tiles. ``PAGE_RUN``: a page holds whole blocks
    (``page_size`` a multiple of ``BLOCK_N``), and the block's page is entry ``block`` of
    ``pages`` (``chunk_pages``: looked up once a chunk, not here).
    ``TMA`` (with ``PAGE_RUN``): ``k_ptr``/``v_ptr`` are tensor descriptors over the pages
    as ``[pages * page_size, kv_heads * HEAD_DIM]`` rows with ``[BLOCK_N, HEAD_DIM]`` boxes;
    a page's rows past ``end`` hold other positions' bytes, zeroed here as the masked load
    zeroes them."""
    dims = tl.arange(0, HEAD_DIM)
    cols = start + tl.arange(0, BLOCK_N)
    col_ok = cols < end
    # One return, after both branches: Triton compiles the code after a constexpr branch that
    # returns, so the pointer loads would be built on descriptors.
    if TMA:
        row = block_page(pages, block) * page_size + start % page_size
        k = k_ptr.load([row, kv_head * HEAD_DIM])
        v = v_ptr.load([row, kv_head * HEAD_DIM])
        if CHECK_END:
            k = tl.where(col_ok[:, None], k, 0.0)
            v = tl.where(col_ok[:, None], v, 0.0)
    else:
        if PAGE_RUN:
            page = block_page(pages, block)
            slot = page.to(tl.int64) * page_size + (start % page_size) + tl.arange(0, BLOCK_N)
        else:
            page = tl.load(table_ptr + seq * max_pages + cols // page_size, mask=col_ok,
                           other=0)
            slot = page.to(tl.int64) * page_size + cols % page_size
        offsets = slot[:, None] * sk_tok + kv_head * sk_h + dims[None, :]
        if CHECK_END:
            k = tl.load(k_ptr + offsets, mask=col_ok[:, None], other=0.0)
            v = tl.load(v_ptr + offsets, mask=col_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptr + offsets)
            v = tl.load(v_ptr + offsets)
    return k, v


@triton.jit
def chunk_pages(table_ptr, seq, max_pages, page_size, chunk_start, BLOCK_N: tl.constexpr,
                PER_CHUNK: tl.constexpr, PAGE_RUN: tl.constexpr):
    """The page of each of the ``PER_CHUNK`` key blocks from ``chunk_start`` (pages holding
    whole blocks), in one vector load; zeros without ``PAGE_RUN`` (``load_block`` then looks
    each key up itself). Looked up before a chunk's block loop, so the address of a block's
    keys is arithmetic on registers: a lookup inside the loop is a scalar load the software
    pipeline does not issue ahead, and each block's key load waited for it: 22.7 ms a 32k
    layer on an H100 against 19.0 with the lookups here, where a third pipeline stage then
    pays (``benchmarks/results/attention_sweep_h100_chunk_pages.txt``)."""
    if PAGE_RUN:
        index = (chunk_start + tl.arange(0, PER_CHUNK) * BLOCK_N) // page_size
        return tl.load(table_ptr + seq * max_pages + index, mask=index < max_pages, other=0)
    else:
        return tl.zeros([PER_CHUNK], tl.int32)


@triton.jit
def block_page(pages, block):
    """Entry ``block`` of a chunk's ``pages`` (a select and a sum over a few registers)."""
    return tl.sum(tl.where(tl.arange(0, pages.shape[0]) == block, pages, 0), 0)


@triton.jit
def attend_block(q, k, v, m_i, l_i, acc, start, end, last_visible, scale_log2,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """One key block into a chunk's running (maximum, sum, output), all fp32; ``m_i`` is
    kept unscaled. ``MASKED``: keys past ``end`` or a row's ``last_visible`` do not count
    (without it every key counts: the caller knows every row sees the whole block)."""
    scores = dot_at(q, tl.trans(k), PRECISION)
    if MASKED:
        cols = start + tl.arange(0, BLOCK_N)
        visible = (cols[None, :] < end) & (cols[None, :] <= last_visible[:, None])
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2((scores - m_safe[:, None]) * scale_log2)
    alpha = tl.exp2((m_i - m_safe) * scale_log2)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = dot_acc(p.to(v.dtype), v, acc * alpha[:, None], PRECISION)
    return m_new, l_i, acc


@triton.jit
def merge_chunk(m_run, l_run, acc_run, m_s, l_s, acc_s, scale_log2):
    """Fold one chunk's partial into the running one (chunks in key order). A chunk a row
    does not see (-inf, 0, 0) leaves the row's running values exactly as they were; the
    first chunk folded into (-inf, 0, 0) comes out unchanged."""
    m_new = tl.maximum(m_run, m_s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2((m_run - m_safe) * scale_log2)
    beta = tl.exp2((m_s - m_safe) * scale_log2)
    return m_new, l_run * alpha + l_s * beta, acc_run * alpha[:, None] + acc_s * beta[:, None]


@triton.jit
def chunk_softmax(q, k_ptr, v_ptr, table_ptr, seq, max_pages, page_size, sk_tok, sk_h, kv_head,
                  chunk_start, chunk_end, last_visible, scale_log2,
                  HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                  PER_CHUNK: tl.constexpr, PAGE_RUN: tl.constexpr, PRECISION: tl.constexpr):
    """Keys ``[chunk_start, chunk_end)`` (at most ``PER_CHUNK`` blocks) of one sequence for
    ``BLOCK_R`` query rows: the chunk's (maximum, sum, unnormalized output) from scratch. A
    row that sees none of them gets (-inf, 0, 0)."""
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], tl.float32)
    pages = chunk_pages(table_ptr, seq, max_pages, page_size, chunk_start, BLOCK_N, PER_CHUNK,
                        PAGE_RUN)
    for start in range(chunk_start, chunk_end, BLOCK_N):
        k, v = load_block(k_ptr, v_ptr, table_ptr, seq, max_pages, page_size, sk_tok, sk_h,
                          kv_head, start, chunk_end, pages, (start - chunk_start) // BLOCK_N,
                          HEAD_DIM, BLOCK_N, PAGE_RUN, True)
        m_i, l_i, acc = attend_block(q, k, v, m_i, l_i, acc, start, chunk_end, last_visible,
                                     scale_log2, BLOCK_N, True, PRECISION)
    return m_i, l_i, acc


def precision_for(dtype: object) -> str:
    """The dots' input precision: fp32 in IEEE (no TF32), bf16/fp16 as they are."""
    import torch

    return "ieee" if dtype == torch.float32 else "tf32"


def check_chunk(chunk: int, block_n: int = BLOCK_N) -> None:
    """Refuse a chunk that is not a power-of-two number of ``block_n``-key blocks (a chunk's
    pages are one ``tl.arange`` vector)."""
    blocks = chunk // block_n
    if chunk <= 0 or chunk % block_n or blocks & (blocks - 1):
        raise ValueError(f"a chunk must be a power-of-two multiple of {block_n} keys, "
                         f"got {chunk}")


def page_run(page_size: int, block_n: int = BLOCK_N) -> bool:
    """Whether a page holds whole key blocks of ``block_n`` (one table lookup per block)."""
    return page_size % block_n == 0
