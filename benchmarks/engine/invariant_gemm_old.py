"""The deterministic mode's matmul before ``kvtier.engine.invariant_gemm``: one 64 x 64 x 64 tile,
Triton's default warps and stages, the inner dimension summed in order in fp32 and rounded once.
Kept here only so that ``invariant_gemm.py`` (this folder) times it beside its successor.
Import it after ``TRITON_INTERPRET`` is settled (the kernel is built at import). Main thread.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtier.engine.rounding import INTERPRET, dot, round_to

TILE_M, TILE_N, TILE_K = 64, 64, 64


@triton.jit(do_not_specialize=["n_rows"])
def _matmul_kernel(x_ptr, w_ptr, b_ptr, out_ptr, n_rows, n_cols, inner, sx_m, sw_n, so_m,
                   HAS_BIAS: tl.constexpr, TILE_M: tl.constexpr, TILE_N: tl.constexpr,
                   TILE_K: tl.constexpr, INTERPRET: tl.constexpr):
    """One output tile of ``x @ w.T (+ b)``: fp32 sums over the inner dimension in order."""
    rows = tl.program_id(0) * TILE_M + tl.arange(0, TILE_M)
    cols = tl.program_id(1) * TILE_N + tl.arange(0, TILE_N)
    steps = tl.arange(0, TILE_K)
    acc = tl.zeros([TILE_M, TILE_N], tl.float32)
    for start in range(0, inner, TILE_K):
        ks = start + steps
        x = tl.load(x_ptr + rows[:, None] * sx_m + ks[None, :],
                    mask=(rows[:, None] < n_rows) & (ks[None, :] < inner), other=0.0)
        w = tl.load(w_ptr + cols[:, None] * sw_n + ks[None, :],
                    mask=(cols[:, None] < n_cols) & (ks[None, :] < inner), other=0.0)
        acc += dot(x, tl.trans(w), INTERPRET)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + rows[:, None] * so_m + cols[None, :], round_to(acc, out_ty).to(out_ty),
             mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))


def old_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for 2-D ``x`` with the old kernel."""
    n_cols = weight.shape[0]
    out = torch.empty((x.shape[0], n_cols), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(x.shape[0], TILE_M), triton.cdiv(n_cols, TILE_N))
    _matmul_kernel[grid](x, weight, bias if bias is not None else weight, out, x.shape[0],
                         n_cols, x.shape[1], x.stride(0), weight.stride(0), out.stride(0),
                         HAS_BIAS=bias is not None, TILE_M=TILE_M, TILE_N=TILE_N, TILE_K=TILE_K,
                         INTERPRET=INTERPRET, enable_fp_fusion=False)
    return out
