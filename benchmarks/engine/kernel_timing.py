"""How the kernel benchmarks time one call and rate causal attention: shared by
``engine_vs_vllm_kernel.py`` and ``attention_sweep.py``.

Owns ``device_ms`` (a call's mean time over CUDA events after one warm-up, or one wall-clock
run on the CPU, where the scripts only dry-run) and ``causal_tflops`` (the rate of a causal
prompt's attention: four multiply-adds' worth of FLOPs a (query, key) pair, head and head-dim
element). Called on the main thread of the script that imports it.
"""

from __future__ import annotations

import time
from typing import Any


def device_ms(fn: Any, iters: int, cuda: bool) -> float:
    """Milliseconds one ``fn()`` takes: the mean of ``iters`` back-to-back calls between two
    CUDA events after a warm-up call; on the CPU, one timed call after the warm-up."""
    import torch

    fn()
    if not cuda:
        started = time.perf_counter()
        fn()
        return (time.perf_counter() - started) * 1e3
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return float(begin.elapsed_time(end)) / iters


def causal_tflops(heads: int, dim: int, length: int, ms: float) -> float:
    """TFLOP/s of one layer's causal attention over ``length`` tokens done in ``ms``."""
    pairs = length * (length + 1) // 2          # (query, key) pairs a causal prompt has
    return round(4 * heads * dim * pairs / (ms * 1e-3) / 1e12, 1)
