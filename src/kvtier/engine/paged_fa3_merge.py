"""Folding a query row's per-segment FlashAttention 3 results into its attention output.

Owns ``merge``. Where the FA3 prompt attention (``paged_fa3``) cuts a row's keys into fixed
segments, each segment's launch leaves the row an output (normalized over that segment's keys,
in the model's dtype) and its log-sum-exp (fp32). Here one program per (row, block of heads)
folds them back into the softmax over all the row's keys: the largest log-sum-exp first, then
``exp(lse_s - max)`` weights summed with the outputs in fp32 in one fixed order (the full
segments from key 0 up, the row's own segment last), normalized, stored over the row's own
segment's output. The order and the arithmetic depend on the row only, never on the batch
or the grid, so a row folded in a prompt's step and the same row folded in a hit's suffix get
the same bits. A row with no full segment behind it (``count`` 0) is left as its own segment's launch wrote
it (a captured step visits every row it holds, padding included).

Tested on the CPU under ``TRITON_INTERPRET=1`` (``tests/test_paged_fa3.py``). Engine thread only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["max_parts", "n_heads"])
def merge_kernel(out_ptr, lse_ptr, part_ptr, part_lse_ptr, rows_ptr, parts_ptr, counts_ptr,
                 so_t, so_h, sl_h, sl_t, sp_t, sp_h, spl_h, spl_t, max_parts, n_heads,
                 HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr):
    """One row, ``BLOCK_H`` heads: fold the row's ``count`` full-segment partials and its own."""
    item = tl.program_id(0)
    count = tl.load(counts_ptr + item)
    if count > 0:
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        head_ok = heads < n_heads
        dims = tl.arange(0, HEAD_DIM)
        row = tl.load(rows_ptr + item)
        own_lse = tl.load(lse_ptr + heads * sl_h + row * sl_t, mask=head_ok, other=0.0)
        top = own_lse
        for s in range(0, count):
            part = tl.load(parts_ptr + item * max_parts + s)
            lse = tl.load(part_lse_ptr + heads * spl_h + part * spl_t, mask=head_ok, other=0.0)
            top = tl.maximum(top, lse)
        total = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
        for s in range(0, count):
            part = tl.load(parts_ptr + item * max_parts + s)
            lse = tl.load(part_lse_ptr + heads * spl_h + part * spl_t, mask=head_ok, other=0.0)
            weight = tl.exp(lse - top)
            value = tl.load(part_ptr + part * sp_t + heads[:, None] * sp_h + dims[None, :],
                            mask=head_ok[:, None], other=0.0)
            acc += weight[:, None] * value.to(tl.float32)
            total += weight
        own_offsets = row * so_t + heads[:, None] * so_h + dims[None, :]
        own = tl.load(out_ptr + own_offsets, mask=head_ok[:, None], other=0.0)
        own_weight = tl.exp(own_lse - top)
        acc += own_weight[:, None] * own.to(tl.float32)
        total += own_weight
        tl.store(out_ptr + own_offsets, (acc / total[:, None]).to(out_ptr.dtype.element_ty),
                 mask=head_ok[:, None])

def merge(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor,
          rows: torch.Tensor, parts: torch.Tensor, counts: torch.Tensor) -> None:
    """Fold in place: ``out`` ``[T, heads, dim]`` and ``lse`` ``[heads, T]`` (each row's own
    segment), ``part`` ``[P, heads, dim]`` and ``part_lse`` ``[heads, P]`` (the full
    segments' results), ``rows`` ``[C]`` (rows of ``out`` to fold, each once), ``parts``
    ``[C, K]`` (their partials' indices into ``part``, segment order) and ``counts`` ``[C]``
    (how many of a row's ``K`` are real; 0: the row is left alone), all int32."""
    if rows.shape[0] == 0:
        return
    heads, dim = out.shape[1], out.shape[2]
    if lse.shape != (heads, out.shape[0]) or part_lse.shape != (heads, part.shape[0]):
        raise ValueError(f"log-sum-exp shapes {tuple(lse.shape)} / {tuple(part_lse.shape)} "
                         f"are not [heads, tokens] for outputs {tuple(out.shape)} / "
                         f"{tuple(part.shape)}")
    if out.stride(2) != 1 or part.stride(2) != 1:
        raise ValueError("merge needs outputs contiguous in head_dim")
    block_h = min(8, triton.next_power_of_2(heads))
    grid = (rows.shape[0], triton.cdiv(heads, block_h))
    merge_kernel[grid](out, lse, part, part_lse, rows, parts, counts,
                       out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
                       part.stride(0), part.stride(1), part_lse.stride(0), part_lse.stride(1),
                       parts.shape[1], heads, HEAD_DIM=dim, BLOCK_H=block_h)
