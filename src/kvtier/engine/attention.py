"""Attention for a few new tokens over a long past: split-KV Triton kernels, plugged into transformers.

Owns ``split_kv_attention`` (the kernels and their launch) and ``install`` (registers it with
transformers as the ``kvtier`` attention implementation, sdpa for everything else).

A cache hit leaves the model a short suffix (tens of tokens) to run over a long past (up to
100k+ tokens). transformers' sdpa path serves that badly: with grouped-query attention and a
causal mask it first copies every key and value head ``n_rep`` times (``repeat_kv``: 16 GiB of
copies for 32k tokens of an 8B model), then runs a kernel that parallelizes over the few query
rows, leaving most SMs idle while each streams the whole past. Here one program takes one KV
head, a slice of the past and the query rows of every query head that shares it (no copies, the
keys and values are read in place with any token stride, e.g. the page-gathered buffers of
``kv_pages.RoomyLayer``), keeps an online softmax over its slice, and a second kernel merges
the slices with their log-sum-exp (flash-decoding). The mask is causal, aligned bottom-right:
query ``i`` of ``M`` sees keys ``0 .. N - M + i``; that is the engine's only case (one unpadded
sequence, the new tokens last), so the mask tensor transformers builds is not read.

Used on CUDA for bf16/fp16 when the new tokens are few (``MAX_QUERY_TOKENS``); anything else
(the CPU, long prompts, fp32, a dropout, a softcap) goes to transformers' sdpa. Inside
``device_past(past)`` (a captured forward, ``kvtier.engine.graphs``) every call takes the
kernels, over buffers longer than the sequence: the past's length is then read from the device
tensor ``past`` when the kernels run, so one captured launch serves every length. Engine thread.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any

import torch
import triton
import triton.language as tl

from kvtier.engine.rounding import INTERPRET, dot, round_to
from kvtier.transfer.kernels import multiprocessor_count

NAME = "kvtier"
#: New tokens at most for the split-KV path; longer prompts are compute-bound and sdpa's
#: causal flash kernel serves them well.
MAX_QUERY_TOKENS = 128
MAX_SPLITS = 128
BLOCK_N = 64
#: Query rows a program in the deterministic mode, whatever the call (the tile shape decides
#: the order of the products' sums on the GPU).
DETERMINISTIC_BLOCK_M = 64
#: Query rows an in-order merge program folds at once (each row alone, element-wise).
MERGE_ROWS = 32


#: Sizes that change per call are not specialized on: one compile serves every length.
_VARYING = ["n_queries", "n_keys", "chunk", "n_splits"]


#: The past's length on the device, inside ``device_past`` (None: sizes come from the shapes).
_DEVICE_PAST: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar(
    "kvtier_device_past", default=None)


@contextlib.contextmanager
def device_past(past: torch.Tensor) -> Iterator[None]:
    """Within: attention calls take the split-KV kernels whatever the device and dtype, and
    read the past's length from ``past`` (a one-element integer tensor on the model's device)
    when they run; keys and values may be longer than past + new tokens."""
    token = _DEVICE_PAST.set(past)
    try:
        yield
    finally:
        _DEVICE_PAST.reset(token)


@triton.jit(do_not_specialize=_VARYING)
def _partial_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, past_ptr,
                    sq_h, sq_m, sk_h, sk_n, sv_h, sv_n,
                    n_queries, n_keys, n_rep, chunk, n_splits, scale_log2,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PAST_ON_DEVICE: tl.constexpr, FIXED_CHUNK: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """One KV head, one slice of the past, ``BLOCK_M`` query rows (query head, position).
    ``PAST_ON_DEVICE``: ``n_keys`` is ``*past_ptr + n_queries``; the slices are cut here unless
    ``FIXED_CHUNK`` (then slice ``s`` is keys ``s * chunk ..`` whatever the length)."""
    if PAST_ON_DEVICE:
        n_keys = tl.load(past_ptr).to(tl.int32) + n_queries
        if not FIXED_CHUNK:
            chunk = tl.cdiv(tl.cdiv(n_keys, n_splits), BLOCK_N) * BLOCK_N
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rep * n_queries
    q_head = kv_head * n_rep + rows // n_queries
    q_pos = rows % n_queries
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + q_head[:, None] * sq_h + q_pos[:, None] * sq_m + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    last_visible = n_keys - n_queries + q_pos
    start = split * chunk
    # blocks past every row's last visible key would change nothing: skip them
    end = tl.minimum(start + chunk, tl.minimum(n_keys, tl.max(last_visible, 0) + 1))
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for block in range(start, end, BLOCK_N):
        cols = block + tl.arange(0, BLOCK_N)
        col_ok = cols < end
        k = tl.load(k_ptr + kv_head * sk_h + cols[:, None] * sk_n + dims[None, :],
                    mask=col_ok[:, None], other=0.0)
        scores = dot(q, tl.trans(k), INTERPRET) * scale_log2
        visible = col_ok[None, :] & (cols[None, :] <= last_visible[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_head * sv_h + cols[:, None] * sv_n + dims[None, :],
                    mask=col_ok[:, None], other=0.0)
        if INTERPRET:  # the probabilities meet the values in their dtype, as on the GPU
            acc = acc * alpha[:, None] + dot(round_to(p, v.dtype), v, INTERPRET)
        else:
            acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, INTERPRET)
        m_i = m_new
    out_row = q_head * n_queries + q_pos
    has = l_i > 0.0
    acc = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(out_ptr + (out_row[:, None] * n_splits + split) * HEAD_DIM + dims[None, :], acc,
             mask=row_ok[:, None])
    tl.store(lse_ptr + out_row * n_splits + split, lse, mask=row_ok)


@triton.jit(do_not_specialize=["n_queries", "n_splits"])
def _merge_kernel(part_ptr, lse_ptr, out_ptr, so_m, so_h, n_queries, n_splits,
                  HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
    """One query row: weigh each slice's output by its share of the softmax mass."""
    row = tl.program_id(0)
    q_head = row // n_queries
    q_pos = row % n_queries
    splits = tl.arange(0, SPLITS)
    split_ok = splits < n_splits
    lse = tl.load(lse_ptr + row * n_splits + splits, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.where(split_ok & (lse > float("-inf")), tl.exp2(lse - top), 0.0)
    dims = tl.arange(0, HEAD_DIM)
    parts = tl.load(part_ptr + (row * n_splits + splits[:, None]) * HEAD_DIM + dims[None, :],
                    mask=split_ok[:, None], other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + q_pos * so_m + q_head * so_h + dims, round_to(out, out_ty).to(out_ty))


@triton.jit(do_not_specialize=["n_rows", "n_queries", "n_splits"])
def _merge_in_order_kernel(part_ptr, lse_ptr, out_ptr, so_m, so_h, n_rows, n_queries, n_splits,
                           HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):
    """``ROWS`` query rows: fold the slices in in order, as an online softmax over slices.
    Empty slices (log-sum-exp -inf) change nothing, so a row's result depends only on its
    own slices, not on how many the launch had or which rows share the program."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    dims = tl.arange(0, HEAD_DIM)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for split in range(0, n_splits):
        lse = tl.load(lse_ptr + rows * n_splits + split, mask=row_ok, other=float("-inf"))
        part = tl.load(part_ptr + (rows[:, None] * n_splits + split) * HEAD_DIM + dims[None, :],
                       mask=row_ok[:, None], other=0.0)
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        old = tl.exp2(m - m_safe)
        new = tl.exp2(lse - m_safe)
        total = total * old + new
        acc = acc * old[:, None] + part * new[:, None]
        m = m_new
    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    out_ty = out_ptr.dtype.element_ty
    where = out_ptr + (rows % n_queries)[:, None] * so_m + (rows // n_queries)[:, None] * so_h
    tl.store(where + dims[None, :], round_to(out, out_ty).to(out_ty), mask=row_ok[:, None])


def _splits(kv_heads: int, row_blocks: int, n_keys: int, device: torch.device) -> int:
    """Slices of the past: enough programs to fill the chip a few times over."""
    sms = multiprocessor_count(device.index or 0) if device.type == "cuda" else 4
    wanted = -(-4 * sms // (kv_heads * row_blocks))
    return max(1, min(wanted, MAX_SPLITS, -(-n_keys // BLOCK_N)))


def _ceil(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    _, heads, n_queries, dim = query.shape
    kv_heads, n_keys = key.shape[1], key.shape[2]
    if query.shape[0] != 1 or key.shape[0] != 1 or heads % kv_heads or n_keys < n_queries:
        raise ValueError(f"split_kv_attention takes one sequence with N >= M and grouped heads, "
                         f"got query {tuple(query.shape)}, key {tuple(key.shape)}")
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {dim}")
    for tensor in (query, key, value):
        if tensor.stride(-1) != 1:
            raise ValueError("the last dimension of query, key and value must be contiguous")


def split_kv_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       scaling: float | None = None, splits: int | None = None,
                       past: torch.Tensor | None = None,
                       split_tokens: int | None = None) -> torch.Tensor:
    """Causal attention of ``query`` ``[1, heads, M, dim]`` over ``key``/``value``
    ``[1, kv_heads, N, dim]`` (N >= M, the new tokens last, any token and head strides with a
    contiguous last dim). Returns ``[1, M, heads, dim]`` (transformers' attention output).
    With ``past`` (a device tensor, read when the kernels run) only the first ``past + M``
    positions of the keys and values count: the new tokens are those at ``past ..``; nothing
    is read from the host, so the launch can be captured in a CUDA graph.
    ``split_tokens`` (a multiple of ``BLOCK_N``): slices of that many keys from position 0,
    ``DETERMINISTIC_BLOCK_M`` query rows a program and an in-order merge, so that a query's
    result does not depend on the other queries, the length of the past or the launch."""
    _check(query, key, value)
    _, heads, n_queries, dim = query.shape
    kv_heads, n_keys = key.shape[1], key.shape[2]
    rows = heads // kv_heads * n_queries
    if split_tokens is not None:
        if split_tokens <= 0 or split_tokens % BLOCK_N:
            raise ValueError(f"split_tokens must be a positive multiple of {BLOCK_N}")
        block_m, chunk = DETERMINISTIC_BLOCK_M, split_tokens
        n_splits = _ceil(n_keys, chunk)
    else:
        block_m = min(64, max(16, triton.next_power_of_2(rows)))
        n_splits = min(splits or _splits(kv_heads, -(-rows // block_m), n_keys, query.device),
                       MAX_SPLITS)
        chunk = _ceil(_ceil(n_keys, n_splits), BLOCK_N) * BLOCK_N
        if past is None:  # on the device the slices are cut from the real length
            n_splits = _ceil(n_keys, chunk)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(dim)
    partial = torch.empty((heads * n_queries, n_splits, dim), dtype=torch.float32,
                          device=query.device)
    lse = torch.empty((heads * n_queries, n_splits), dtype=torch.float32, device=query.device)
    out = torch.empty((1, n_queries, heads, dim), dtype=query.dtype, device=query.device)
    _partial_kernel[(kv_heads, n_splits, -(-rows // block_m))](
        query, key, value, partial, lse, lse if past is None else past,
        query.stride(1), query.stride(2), key.stride(1), key.stride(2),
        value.stride(1), value.stride(2),
        n_queries, n_keys, heads // kv_heads, chunk, n_splits, scale * math.log2(math.e),
        HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=BLOCK_N, PAST_ON_DEVICE=past is not None,
        FIXED_CHUNK=split_tokens is not None, INTERPRET=INTERPRET)
    if split_tokens is not None:
        _merge_in_order_kernel[(_ceil(heads * n_queries, MERGE_ROWS),)](
            partial, lse, out, out.stride(1), out.stride(2), heads * n_queries, n_queries,
            n_splits, HEAD_DIM=dim, ROWS=MERGE_ROWS, enable_fp_fusion=False)
    else:
        _merge_kernel[(heads * n_queries,)](
            partial, lse, out, out.stride(1), out.stride(2), n_queries, n_splits,
            HEAD_DIM=dim, SPLITS=MAX_SPLITS)
    return out


def fits_split_kv(query: torch.Tensor, key: torch.Tensor, dropout: float,
                  kwargs: dict[str, Any]) -> bool:
    """Whether a call from transformers takes the split-KV path."""
    dim = query.shape[-1]
    return (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)
            and query.shape[0] == 1 and query.shape[2] <= MAX_QUERY_TOKENS
            and key.shape[2] >= query.shape[2] and dim >= 16 and not dim & (dim - 1)
            and not dropout and kwargs.get("softcap") is None
            and kwargs.get("sliding_window") is None and kwargs.get("position_bias") is None
            and query.stride(-1) == 1 and key.stride(-1) == 1)


def kvtier_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0,
                     scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function: split-KV where it fits (always, with the past's length
    read on the device, inside ``device_past``), sdpa otherwise."""
    past = _DEVICE_PAST.get()
    if past is not None:
        return split_kv_attention(query, key, value, scaling, past=past), None
    if fits_split_kv(query, key, dropout, kwargs) and value.stride(-1) == 1:
        return split_kv_attention(query, key, value, scaling), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)


def install(model: Any, name: str = NAME, function: Any = None) -> bool:
    """Make ``model`` (a transformers model) use ``function`` (``kvtier_attention``) registered
    as ``name``, with sdpa's masks. Returns False (and changes nothing) where transformers has
    no attention registry."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:
        return False
    AttentionInterface.register(name, function or kvtier_attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(name)
    else:
        model.config._attn_implementation = name
    return True


def device_past_now() -> torch.Tensor | None:
    """The past's length on the device inside ``device_past`` (None outside)."""
    return _DEVICE_PAST.get()
