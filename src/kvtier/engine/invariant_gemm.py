"""The deterministic mode's matmul: ``x @ w.T (+ b)`` whose bits for a row do not depend on M.

Owns ``matmul`` (called by ``invariant.linear``), ``tiles_for`` (a weight shape's tile and its
inner-dimension segments) and the three kernels. Runs on the thread that calls it (the engine
thread).

**One sum per output element, whatever M is.** An element's sum over the inner dimension K is
cut the same way for every row count: K is walked in steps of ``TILE_K`` (one tile product a
step: an MMA chain on the GPU); ``seg_steps`` consecutive steps make a segment, summed in fp32
from zero; the segments' sums are added in order to a total that starts at 0; then the bias,
then one rounding to the output dtype (``round_to``). The tile (``TILE_M`` x ``TILE_N`` x
``TILE_K``), the warps and the segments depend on the dtype and the weight's shape (N, K) only,
never on M, so nothing here is tuned or chosen by the row count except which launch runs:

- fused (``_fused_kernel``): one program an output tile walks every segment and stores the
  rounded tile. Used when there are enough tiles to fill the GPU (prefill).
- split (``_segment_kernel`` + ``_sum_segments_kernel``): one program per (tile, segment)
  stores its segment's fp32 sum; the second kernel adds a tile's segments in order from 0, adds
  the bias and rounds. Used when the fused launch would leave most SMs idle (a few rows:
  decode, where the weight's bytes are the cost and programs over K are what fill the GPU).

Both launches run the same MMA chain a segment, with the same tile and warps, and the same fp32
additions after it, so they give the same bits; M only picks one. Decode does not get a
smaller row tile: Triton derives the MMA instruction and the spread of a tile's products over
threads from the tile shape and the warps, and nothing promises that two shapes sum an
element alike, so every launch uses one tile and decode gets its parallelism from segments
instead. Rows past M in the last row tile are read as zeros and never stored: an output
element depends only on its own row and column. A pipeline's stage count
moves only when loads are issued, never the order of a sum, so it may differ by launch.

**The tile.** 128 x 128 x 64 on 8 warps for 16-bit inputs (fp32 inputs, summed in IEEE fp32
on the CUDA cores, step by 32 so that a stage stays 32 KiB), row tiles grouped by ``GROUP_M``
for L2 reuse of the weight. It is the common Hopper shape for Triton bf16 matmuls and the
largest whose two fp32 accumulators (the segment's and the total) fit the registers: compiled
for sm_90a (Triton 3.9, ptxas 13.4) the fused kernel takes 170 registers a thread and no
spills, both launches issue the same ``wgmma m64n128k16`` chain, and a 128 x 256 tile with
segments spills (255 registers). Where a weight has one segment (``ONE_SEGMENT``: K of at most
``MIN_SEG_STEPS`` steps, or ``TARGET_PROGRAMS`` column tiles and more, as an lm_head), the
fused kernel keeps one accumulator and adds it to 0 once: the same additions. Pipeline
depth: 4 stages fused (128 KiB of shared memory), 3 split (96 KiB and 110 registers: two
programs an SM for decode's many small ones); a GPU with less shared memory gets fewer
(``_stage_cap``). Segments: ``TARGET_PROGRAMS`` / (column tiles)
of them, at least ``MIN_SEG_STEPS`` steps each, so that a decode's split launch has about 256
programs (two for each of a 132-SM H100's SMs) whatever the device, which keeps the bits the
same across GPUs of one kind with other SM counts. These are design choices, not fitted to a
measurement: benchmarks/engine/invariant_gemm.py times them against cuBLAS and the 64 x 64 x
64 kernel this replaces, times variants (pipeline depths, a 128 x 256 tile with one segment
for wide weights) and checks the bits on the GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from kvtier.engine.rounding import dot_acc, round_to

#: The tile for every M: rows, columns; inner step for 16-bit and for fp32 inputs.
TILE_M, TILE_N, TILE_K_16, TILE_K_32 = 128, 128, 64, 32
WARPS = 8
#: Software-pipeline depth of the fused and the split launch (load timing only).
STAGES, SPLIT_STAGES = 4, 3
#: Row tiles a group of programs walks before the next columns (L2 reuse of the weight tiles).
GROUP_M = 8
#: Programs a split launch aims for (column tiles x segments), and a segment's least depth.
TARGET_PROGRAMS, MIN_SEG_STEPS = 256, 4
#: Elements a program of the segment-summing kernel.
SUM_BLOCK = 1024
#: SM count assumed off CUDA (the interpreter): an H100's.
INTERPRET_SMS = 132


@dataclass(frozen=True)
class Tiles:
    """One weight shape's tile, segments and launch settings."""

    m: int
    n: int
    k: int
    seg_steps: int   # inner steps a segment
    segments: int    # segments over the inner dimension
    warps: int = WARPS
    stages: int = STAGES
    split_stages: int = SPLIT_STAGES
    group: int = GROUP_M


@functools.cache
def tiles_for(dtype: torch.dtype, n_cols: int, inner: int) -> Tiles:
    """The tile and the segments for ``dtype`` inputs and an ``(n_cols, inner)`` weight."""
    tile_k = TILE_K_32 if dtype == torch.float32 else TILE_K_16
    k_steps = triton.cdiv(inner, tile_k)
    wanted = triton.cdiv(TARGET_PROGRAMS, triton.cdiv(n_cols, TILE_N))
    seg_steps = max(MIN_SEG_STEPS, triton.cdiv(k_steps, wanted))
    return Tiles(TILE_M, TILE_N, tile_k, seg_steps, max(1, triton.cdiv(k_steps, seg_steps)))


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
           tiles: Tiles | None = None, split: bool | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for 2-D ``x`` (rows of K, unit stride) and a ``(N, K)``
    weight with unit inner stride, in ``x``'s dtype. ``tiles`` (default ``tiles_for``) and
    ``split`` (default: by the GPU's fill) are for tests and benchmarks."""
    n_rows, inner = x.shape
    n_cols = weight.shape[0]
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if n_rows == 0 or n_cols == 0:
        return out
    tiles = tiles or tiles_for(x.dtype, n_cols, inner)
    if tiles.segments != max(1, triton.cdiv(triton.cdiv(inner, tiles.k), tiles.seg_steps)):
        raise ValueError(f"matmul: {tiles} does not cut an inner dimension of {inner}")
    n_tiles = triton.cdiv(n_rows, tiles.m) * triton.cdiv(n_cols, tiles.n)
    if split is None:
        split = splits(n_rows, n_cols, tiles, x.device)
    shape = dict(TILE_M=tiles.m, TILE_N=tiles.n, TILE_K=tiles.k, GROUP=tiles.group,
                 EVEN_K=inner % tiles.k == 0,
                 PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    b_arg = bias if bias is not None else weight
    if not split:
        _launch(_fused_kernel, (n_tiles,), tiles.warps, tiles.stages,
                x, weight, b_arg, out, n_rows, n_cols, inner, tiles.seg_steps, x.stride(0),
                weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                ONE_SEGMENT=tiles.segments == 1, **shape)
        return out
    part = torch.empty((tiles.segments, n_rows, n_cols), dtype=torch.float32, device=x.device)
    _launch(_segment_kernel, (n_tiles, tiles.segments), tiles.warps, tiles.split_stages,
            x, weight, part, n_rows, n_cols, inner, tiles.seg_steps, x.stride(0),
            weight.stride(0), **shape)
    _sum_segments_kernel[(triton.cdiv(n_rows * n_cols, SUM_BLOCK),)](
        part, b_arg, out, n_rows, n_cols, tiles.segments, HAS_BIAS=bias is not None,
        BLOCK=SUM_BLOCK, enable_fp_fusion=False)
    return out


def splits(n_rows: int, n_cols: int, tiles: Tiles, device: torch.device) -> bool:
    """Whether ``matmul`` takes the split launch: the inner dimension has segments and the
    output tiles would fill at most half the SMs (the bits are the same either way)."""
    n_tiles = triton.cdiv(n_rows, tiles.m) * triton.cdiv(n_cols, tiles.n)
    return tiles.segments > 1 and 2 * n_tiles <= _sm_count(device)


#: Highest stage count that fitted, per (kernel, tile, dtype), learned on the first launch.
_stage_cap: dict[tuple[object, ...], int] = {}


def _launch(kernel: triton.JITFunction, grid: tuple[int, ...], warps: int, stages: int,
            *args: object, **constants: object) -> None:
    """Launch with ``stages``, or with fewer where shared memory is short (a stage count
    changes when loads are issued, never a sum)."""
    x = args[0]
    assert isinstance(x, torch.Tensor)
    key = (kernel.fn.__name__, x.dtype, tuple(sorted(constants.items())))
    stages = min(stages, _stage_cap.get(key, stages))
    while True:
        try:
            kernel[grid](*args, **constants, num_warps=warps, num_stages=stages,
                         enable_fp_fusion=False)
            return
        except OutOfResources:
            if stages <= 1:
                raise
            stages -= 1
            _stage_cap[key] = stages


@functools.cache
def _sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRET_SMS
    return _sms(device.index if device.index is not None else torch.cuda.current_device())


# ---- kernels ---------------------------------------------------------------------------------

@triton.jit
def _tile_of(pid, n_rows, n_cols, TILE_M: tl.constexpr, TILE_N: tl.constexpr,
             GROUP: tl.constexpr):
    """Program ``pid``'s (row tile, column tile), ``GROUP`` row tiles at a time."""
    tiles_m = tl.cdiv(n_rows, TILE_M)
    per_group = GROUP * tl.cdiv(n_cols, TILE_N)
    first_m = (pid // per_group) * GROUP
    group_rows = tl.minimum(tiles_m - first_m, GROUP)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def _operands(x_ptr, w_ptr, tile_m, tile_n, first_step, n_rows, n_cols, sx_m, sw_n,
              TILE_M: tl.constexpr, TILE_N: tl.constexpr, TILE_K: tl.constexpr):
    """Pointers to the x tile (rows x steps) and the w tile (steps x columns) of a step, and
    which of the tile's rows exist. Columns past the end wrap onto valid ones (read, never
    stored); rows past the end are not read at all (``_step`` masks them to zeros): with few
    rows, wrapped rows would all ask one address, and those requests queue at one L2 slice (a
    1-row matmul ran 1.3-2.4x slower than a 16-row one before). An element's sum takes only
    its own row and column, so neither changes a stored bit."""
    rows = tile_m * TILE_M + tl.arange(0, TILE_M)
    row_ok = rows < n_rows
    cols = (tile_n * TILE_N + tl.arange(0, TILE_N)) % n_cols
    ks = first_step * TILE_K + tl.arange(0, TILE_K)
    return (x_ptr + (rows % n_rows).to(tl.int64)[:, None] * sx_m + ks[None, :],
            w_ptr + cols.to(tl.int64)[None, :] * sw_n + ks[:, None], row_ok)


@triton.jit
def _step(x_ptrs, w_ptrs, row_ok, acc, step, inner, TILE_K: tl.constexpr, EVEN_K: tl.constexpr,
          PRECISION: tl.constexpr):
    """``acc`` plus one step's tile product (zeros past the inner dimension's end and in rows
    that do not exist)."""
    if EVEN_K:
        x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        w = tl.load(w_ptrs)
    else:
        left = inner - step * TILE_K
        ks = tl.arange(0, TILE_K)
        x = tl.load(x_ptrs, mask=row_ok[:, None] & (ks[None, :] < left), other=0.0)
        w = tl.load(w_ptrs, mask=ks[:, None] < left, other=0.0)
    return dot_acc(x, w, acc, PRECISION)


@triton.jit(do_not_specialize=["n_rows", "seg_steps"])   # one compile for every row count
def _fused_kernel(x_ptr, w_ptr, b_ptr, out_ptr, n_rows, n_cols, inner, seg_steps, sx_m, sw_n,
                  so_m, HAS_BIAS: tl.constexpr, ONE_SEGMENT: tl.constexpr,
                  TILE_M: tl.constexpr, TILE_N: tl.constexpr, TILE_K: tl.constexpr,
                  GROUP: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    """One output tile: each segment summed from zero, added in order to a total from 0 (one
    loop over the steps; the segment's sum is folded in and restarted at its last step)."""
    tile_m, tile_n = _tile_of(tl.program_id(0), n_rows, n_cols, TILE_M, TILE_N, GROUP)
    x_ptrs, w_ptrs, row_ok = _operands(x_ptr, w_ptr, tile_m, tile_n, 0, n_rows, n_cols, sx_m, sw_n,
                               TILE_M, TILE_N, TILE_K)
    n_steps = tl.cdiv(inner, TILE_K)
    acc = tl.zeros([TILE_M, TILE_N], tl.float32)
    if ONE_SEGMENT:   # the same additions with one accumulator live: 0 + the one segment
        for step in range(0, n_steps):
            acc = _step(x_ptrs, w_ptrs, row_ok, acc, step, inner, TILE_K, EVEN_K, PRECISION)
            x_ptrs += TILE_K
            w_ptrs += TILE_K
        total = tl.zeros([TILE_M, TILE_N], tl.float32) + acc
    else:
        total = tl.zeros([TILE_M, TILE_N], tl.float32)
        for step in range(0, n_steps):
            acc = _step(x_ptrs, w_ptrs, row_ok, acc, step, inner, TILE_K, EVEN_K, PRECISION)
            x_ptrs += TILE_K
            w_ptrs += TILE_K
            if ((step + 1) % seg_steps == 0) | (step + 1 == n_steps):   # a segment's end
                total += acc
                acc = tl.zeros([TILE_M, TILE_N], tl.float32)
    rows = tile_m * TILE_M + tl.arange(0, TILE_M)
    cols = tile_n * TILE_N + tl.arange(0, TILE_N)
    if HAS_BIAS:
        total += tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * so_m + cols[None, :],
             round_to(total, out_ty).to(out_ty),
             mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))


@triton.jit(do_not_specialize=["n_rows", "seg_steps"])
def _segment_kernel(x_ptr, w_ptr, part_ptr, n_rows, n_cols, inner, seg_steps, sx_m, sw_n,
                    TILE_M: tl.constexpr, TILE_N: tl.constexpr, TILE_K: tl.constexpr,
                    GROUP: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    """One output tile's sum over one segment (``program_id(1)``), from zero, stored in fp32."""
    tile_m, tile_n = _tile_of(tl.program_id(0), n_rows, n_cols, TILE_M, TILE_N, GROUP)
    segment = tl.program_id(1)
    first = segment * seg_steps
    x_ptrs, w_ptrs, row_ok = _operands(x_ptr, w_ptr, tile_m, tile_n, first, n_rows, n_cols, sx_m,
                               sw_n, TILE_M, TILE_N, TILE_K)
    acc = tl.zeros([TILE_M, TILE_N], tl.float32)
    for step in range(first, tl.minimum(first + seg_steps, tl.cdiv(inner, TILE_K))):
        acc = _step(x_ptrs, w_ptrs, row_ok, acc, step, inner, TILE_K, EVEN_K, PRECISION)
        x_ptrs += TILE_K
        w_ptrs += TILE_K
    rows = tile_m * TILE_M + tl.arange(0, TILE_M)
    cols = tile_n * TILE_N + tl.arange(0, TILE_N)
    base = part_ptr + segment.to(tl.int64) * n_rows * n_cols
    tl.store(base + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], acc,
             mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))


@triton.jit(do_not_specialize=["n_rows"])
def _sum_segments_kernel(part_ptr, b_ptr, out_ptr, n_rows, n_cols, segments,
                         HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """``BLOCK`` outputs: their segments added in order to a total from 0, the bias, one
    rounding (the fused kernel's additions, element by element)."""
    size = n_rows.to(tl.int64) * n_cols
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = idx < size
    total = tl.zeros([BLOCK], tl.float32)
    for segment in range(0, segments):
        total += tl.load(part_ptr + segment * size + idx, mask=inside, other=0.0)
    if HAS_BIAS:
        total += tl.load(b_ptr + idx % n_cols, mask=inside, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + idx, round_to(total, out_ty).to(out_ty), mask=inside)
