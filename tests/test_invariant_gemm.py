"""The deterministic mode's matmul (``kvtier.engine.invariant_gemm``) in the Triton interpreter:
a row's bits do not depend on how many rows share the call nor on which launch (fused, or split
over the inner dimension's segments) computed it; results match an fp32 reference, with and
without bias, for widths that are not multiples of the tile; the segments follow the weight's
shape only; a launch short of shared memory retries with fewer pipeline stages. Small tiles
(16 x 16 x 16, two steps a segment) keep the shapes small while still giving several row, column
and segment tiles and ragged ends."""

from __future__ import annotations

import inspect

import pytest
import torch
from triton.runtime.errors import OutOfResources

from kvtier.engine import invariant, invariant_gemm
from kvtier.engine.invariant_gemm import Tiles, matmul, tiles_for

SMALL = Tiles(16, 16, 16, seg_steps=2, segments=4)   # K=100: 7 steps, segments of 2,2,2,1


def _small(k: int) -> Tiles:
    """``SMALL``'s tile and segment depth for an inner dimension of ``k``."""
    return Tiles(16, 16, 16, seg_steps=2, segments=max(1, -(-k // 32)))


def _operands(rows: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    return x, weight, bias


@pytest.mark.parametrize("tiles", [Tiles(32, 16, 16, seg_steps=2, segments=4),
                                   Tiles(32, 16, 16, seg_steps=7, segments=1)],
                         ids=["segments", "one-segment"])
def test_a_row_has_the_same_bits_in_every_batch_and_launch(tiles):
    # fp32 outputs show a sum's every bit (a bf16 rounding would hide most reorderings)
    x, weight, bias = _operands(130, 37, 100, torch.float32)
    whole = matmul(x, weight, bias, tiles=tiles, split=False)
    assert torch.equal(whole, matmul(x, weight, bias, tiles=tiles, split=True))
    for first, count in ((0, 1), (129, 1), (5, 3), (40, 17)):
        part = x[first:first + count]
        for split in (False, True):
            got = matmul(part, weight, bias, tiles=tiles, split=split)
            assert torch.equal(got, whole[first:first + count]), (first, count, split)


def test_the_default_tiles_keep_a_row_alike_through_linear():
    x, weight, bias = _operands(131, 150, 200, torch.float32)   # 7 steps, 2 segments
    whole = invariant.linear(x.view(1, 131, 200), weight, bias)
    assert whole.shape == (1, 131, 150)
    for first, count in ((0, 1), (7, 3), (129, 2)):
        got = invariant.linear(x[first:first + count], weight, bias)
        assert torch.equal(got, whole[0, first:first + count])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_an_fp32_reference(dtype, with_bias):
    x, weight, bias = _operands(21, 37, 100, dtype, seed=1)
    bias_arg = bias if with_bias else None
    want = torch.nn.functional.linear(x.double(), weight.double(),
                                      bias.double() if with_bias else None)
    # an output rounded to dtype: half an ulp of the largest value, plus the fp32 sums' error
    ulp = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -22}[dtype]
    bound = float(want.abs().max()) * ulp + 1e-4
    for tiles, split in ((SMALL, False), (SMALL, True), (None, None)):
        got = matmul(x, weight, bias_arg, tiles=tiles, split=split)
        assert got.dtype == dtype and got.shape == (21, 37)
        assert float((got.double() - want).abs().max()) <= bound, (tiles, split)


def test_odd_widths_and_empty_inputs():
    for n, k in ((1, 1), (17, 15), (33, 48)):   # K under one step, ragged, an exact multiple
        x, weight, bias = _operands(5, n, k)
        want = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
        for split in (False, True):
            got = matmul(x, weight, bias, tiles=_small(k), split=split)
            assert torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2), (n, k, split)
    x, weight, bias = _operands(0, 8, 16)
    assert matmul(x, weight, bias).shape == (0, 8)
    x, weight, bias = _operands(4, 8, 48)   # 3 steps: 2 segments of 2, not SMALL's 4
    with pytest.raises(ValueError, match="does not cut"):
        matmul(x, weight, bias, tiles=SMALL)


def test_the_segments_follow_the_weight_only():
    assert "rows" not in str(inspect.signature(tiles_for))
    # llama3-8b's linears in bf16: about TARGET_PROGRAMS programs for a decode's split launch
    for n, k, segments in ((6144, 4096, 6), (4096, 4096, 8), (28672, 4096, 2), (4096, 14336, 8)):
        tiles = tiles_for(torch.bfloat16, n, k)
        assert (tiles.m, tiles.n, tiles.k) == (128, 128, 64)
        assert tiles.segments == segments
        assert (tiles.segments - 1) * tiles.seg_steps < k // 64 <= tiles.segments * tiles.seg_steps
    assert tiles_for(torch.float32, 4096, 4096).k == 32
    assert tiles_for(torch.bfloat16, 256, 128).segments == 1   # two steps: nothing to split


def test_few_rows_take_the_split_launch(monkeypatch):
    launched: list[str] = []
    real = invariant_gemm._launch

    def record(kernel, *args, **kwargs):
        launched.append(kernel.fn.__name__)
        real(kernel, *args, **kwargs)

    monkeypatch.setattr(invariant_gemm, "_launch", record)
    monkeypatch.setattr(invariant_gemm, "INTERPRET_SMS", 8)
    x, weight, bias = _operands(70, 37, 100, torch.float32)
    few = matmul(x[:3], weight, bias, tiles=SMALL)     # 3 tiles: a split launch fills more
    many = matmul(x, weight, bias, tiles=SMALL)        # 15 tiles: fused
    assert launched == ["_segment_kernel", "_fused_kernel"]
    assert torch.equal(few, many[:3])


def test_a_launch_short_of_shared_memory_retries_with_fewer_stages(monkeypatch):
    monkeypatch.setattr(invariant_gemm, "_stage_cap", {})
    tried: list[int] = []

    class Kernel:
        def fn(self) -> None:   # named like a JITFunction's wrapped function
            pass

        def __getitem__(self, grid):
            def launch(*args, num_stages, **kwargs):
                tried.append(num_stages)
                if num_stages > 2:
                    raise OutOfResources(160_000, 101_376, "shared memory")
            return launch

    x = torch.zeros(2, 2)
    invariant_gemm._launch(Kernel(), (1,), 8, 4, x, TILE_K=16)
    invariant_gemm._launch(Kernel(), (1,), 8, 4, x, TILE_K=16)
    assert tried == [4, 3, 2, 2]    # learned once, then launched at the depth that fits
