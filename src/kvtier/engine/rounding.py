"""Triton helpers that round and multiply the way the GPU does, in compiled and interpreted runs.

Owns ``round_to`` (an fp32 value rounded to bf16, fp16 or fp32, to nearest with ties to even,
returned in fp32), ``dot``, ``dot_at`` and ``dot_acc`` (tile products with fp32 accumulation)
and ``INTERPRET`` (whether Triton runs in its CPU interpreter). The interpreter's own casts
truncate fp32 to bf16, and its ``tl.dot`` mishandles bf16 operands; the GPU rounds to nearest
and multiplies bf16 exactly into fp32. These helpers give both the GPU's results, so the CPU
tests check what the GPU computes: ``round_to`` rounds with integer bit operations (the same on
every backend; a NaN may come back as an infinity), ``dot`` multiplies fp32 copies of bf16/fp16
tiles in the interpreter (each product of two bf16 or fp16 values is exact in fp32, as in the
tensor cores) and fp32 tiles in full fp32 (no TF32).

In the interpreter ``dot`` sums each output over the shared dimension itself rather than
calling ``tl.dot``: the interpreter's ``tl.dot`` is numpy's matmul, i.e. the machine's BLAS, and
some BLAS kernels (OpenBLAS's Haswell and Zen ones among them) round a row's sums differently
depending on where the row sits in the tile. A GPU's MMA computes every output from its own row
and column alike, so a query's bits do not depend on which tile row it lands in; the summed
form keeps that property on every CPU, which is what the bit-identity tests check. Called from
kernels on whatever thread launches them.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

#: Kernels take this as a constexpr: the interpreter needs ``dot``'s fp32 detour.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: The same, read by ``dot_at`` as a global (its callers pass a precision instead).
_INTERPRET_DOT: tl.constexpr = tl.constexpr(INTERPRET)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """``x`` (fp32) rounded to ``dtype`` to nearest, ties to even, as fp32 again."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def dot(a, b, INTERPRET_MODE: tl.constexpr):
    """``a @ b`` with fp32 accumulation; fp32 operands in full fp32."""
    if INTERPRET_MODE:
        # one fixed order of sums for every output, whatever its row (see the module notes)
        return _summed_dot(a, b)
    elif a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def dot_at(a, b, PRECISION: tl.constexpr):
    """``tl.dot(a, b, input_precision=PRECISION)`` on the GPU; in the interpreter, the same
    product summed in one fixed order for every output (see the module notes)."""
    if _INTERPRET_DOT:
        return _summed_dot(a, b)
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def dot_acc(a, b, acc, PRECISION: tl.constexpr):
    """``acc + a @ b`` (``tl.dot``'s accumulating form, the products summed into ``acc`` by
    the tensor cores) on the GPU; in the interpreter, ``acc`` plus the fixed-order product."""
    if _INTERPRET_DOT:
        return acc + _summed_dot(a, b)
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _summed_dot(a, b):
    """``a @ b`` in fp32, each output summed over the shared dimension in the same order."""
    return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
