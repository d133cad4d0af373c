"""How the kernel benchmarks time one call and rate causal attention: shared by
``engine_vs_vllm_kernel.py``, ``attention_sweep.py`` and ``attention_ceiling.py``.

Owns ``device_ms`` (a call's mean time over CUDA events after one warm-up, or one wall-clock
run on the CPU, where the scripts only dry-run), ``causal_tflops`` (the rate of a causal
prompt's attention: four multiply-adds' worth of FLOPs a (query, key) pair, head and head-dim
element) and ``preset_heads`` (a preset's query heads, KV heads and head_dim). Called on the
main thread of the script that imports it.
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


def preset_heads(preset: str) -> tuple[int, int, int]:
    """Query heads, KV heads and head_dim of one of kvtier's model presets."""
    from kvtier.engine.presets import PRESETS

    config = PRESETS[preset].config
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    return heads, kv_heads, int(config.get("head_dim") or config["hidden_size"] // heads)
