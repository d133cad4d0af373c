"""``engine_vs_vllm.py``'s ``kernel`` case: the paged prefill kernel (``kvtier.engine.paged_triton``)
against flash ``scaled_dot_product_attention`` on one layer's shape (TFLOP/s of the causal work,
pages of 64 and 16 tokens, a long prompt in the engine's 8192-token steps), then the numerics
contract on the device: a prompt computed whole, in steps and as a hit's suffix (the flash
kernel and the split launch) must be bit-identical. The main thread of the child process
(``engine_vs_vllm.py --case kernel``) runs it.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kernel_timing import causal_tflops, device_ms, preset_heads
from vllm_gpu_case import log


def kernel_case(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from kvtier.engine import paged_prefill_split, paged_triton

    heads, kv_heads, dim = preset_heads(args.preset)
    dtype, device = torch.bfloat16, torch.device(args.device)   # cpu: TRITON_INTERPRET=1
    scale = dim ** -0.5
    n_rep = heads // kv_heads
    gen = torch.Generator(device=device).manual_seed(0)

    def pages_for(length: int, page: int) -> tuple[Any, Any, Any]:
        count = -(-length // page)
        k = torch.randn((count, page, kv_heads, dim), generator=gen, device=device, dtype=dtype)
        v = torch.randn((count, page, kv_heads, dim), generator=gen, device=device, dtype=dtype)
        order = torch.randperm(count, generator=gen, device=device)   # scattered pages
        return k, v, order.to(torch.int32)[None]

    def tiles(start: int, count: int) -> Any:
        per = paged_triton.tokens_per_tile(n_rep)
        rows = [(0, off, min(per, count - off), start + off) for off in range(0, count, per)]
        return torch.as_tensor(rows, dtype=torch.int32, device=device)

    def paged(q: Any, k: Any, v: Any, table: Any, start: int, out: Any, t: Any = None) -> Any:
        t = tiles(start, q.shape[0]) if t is None else t   # built outside timed loops
        return paged_triton.paged_attention(q, k, v, table, t, scale,
                                            paged_triton.tokens_per_tile(n_rep), out)

    def timed(fn: Any, iters: int) -> float:
        return device_ms(fn, iters, device.type == "cuda")   # the CPU: a dry run

    def tflops(length: int, ms: float) -> float:
        return causal_tflops(heads, dim, length, ms)

    def sdpa_time(q4: Any, k4: Any, v4: Any, iters: int) -> tuple[Any, float, str]:
        def call() -> Any:
            return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return call(), timed(call, iters), "flash"
        except Exception as exc:   # no flash backend here: whatever sdpa picks
            return call(), timed(call, iters), f"default ({type(exc).__name__})"

    def measure(q: Any, page: int) -> dict[str, Any]:
        length = q.shape[0]
        iters = max(3, min(50, (1 << 27) // (length * length // 64 + 1)))
        k, v, table = pages_for(length, page)
        out = torch.empty_like(q)
        whole = tiles(0, length)
        paged_ms = timed(lambda: paged(q, k, v, table, 0, out, whole), iters)
        slots = (table[0].long()[:, None] * page + torch.arange(page, device=device))
        slots = slots.reshape(-1)[:length]
        k4 = k.reshape(-1, kv_heads, dim)[slots].transpose(0, 1)[None]
        v4 = v.reshape(-1, kv_heads, dim)[slots].transpose(0, 1)[None]
        want, sdpa_ms, backend = sdpa_time(
            q.transpose(0, 1)[None], k4.repeat_interleave(n_rep, 1).contiguous(),
            v4.repeat_interleave(n_rep, 1).contiguous(), iters)
        err = (out.float() - want[0].transpose(0, 1).float()).abs().max().item()
        row = {"tokens": length, "page_size": page, "paged_ms": round(paged_ms, 3),
               "paged_tflops": tflops(length, paged_ms), "sdpa_backend": backend,
               "sdpa_ms": round(sdpa_ms, 3), "sdpa_tflops": tflops(length, sdpa_ms),
               "paged_over_sdpa_time": round(paged_ms / sdpa_ms, 3),
               "max_abs_diff_vs_sdpa": err}
        if length >= 16384 and page == 64:   # the engine's 8192-token prefill steps
            step = 8192
            steps = [(s, tiles(s, min(step, length - s))) for s in range(0, length, step)]

            def stepped() -> None:
                for s, t in steps:
                    paged(q[s:s + step], k, v, table, s, out[s:s + step], t)
            chunk_ms = timed(stepped, max(3, iters // 2))
            row["in_8192_steps_ms"] = round(chunk_ms, 3)
            row["in_8192_steps_tflops"] = tflops(length, chunk_ms)
        return row

    rows: list[dict[str, Any]] = []
    for length in args.lengths:
        q = torch.randn((length, heads, dim), generator=gen, device=device, dtype=dtype)
        for page in (64, 16):
            rows.append(measure(q, page))
            log(f"kernel {json.dumps(rows[-1])}")
            if device.type == "cuda":
                torch.cuda.empty_cache()

    # the numerics contract on the GPU: whole, stepped, suffix (flash and split launch)
    bitwise: dict[str, bool] = {}
    for check_dtype, extra in ((torch.bfloat16, 8192), (torch.float32, 2048)):
        label = "bf16" if check_dtype == torch.bfloat16 else "fp32"
        total, page = min(extra, max(args.lengths)) + 777, 64
        q = torch.randn((total, heads, dim), generator=gen, device=device).to(check_dtype)
        k, v, table = (t.to(check_dtype) if t.is_floating_point() else t
                       for t in pages_for(total, page))
        whole = paged(q, k, v, table, 0, torch.full_like(q, float("nan")))
        for size in (8192, 2048, 1000, 333, 97):
            parts = [paged(q[s:s + size], k, v, table, s,
                           torch.full_like(q[s:s + size], float("nan")))
                     for s in range(0, total, size)]
            bitwise[f"{label}_steps_of_{size}"] = bool(torch.equal(torch.cat(parts), whole))
        for past in sorted({p for p in (8192, total - 100, total - 32, total - 7)
                            if 0 < p < total}):
            suffix = paged(q[past:], k, v, table, past, torch.full_like(q[past:], float("nan")))
            bitwise[f"{label}_flash_suffix_after_{past}"] = bool(torch.equal(suffix,
                                                                             whole[past:]))
            if total - past <= 32:
                t = tiles(past, total - past)
                parts_buf = paged_prefill_split.partials(
                    t.shape[0], kv_heads, -(-total // paged_triton.CHUNK_TOKENS), dim, device)
                split = paged_prefill_split.split_prefill(
                    q[past:], k, v, table, t, scale, torch.full_like(q[past:], float("nan")),
                    parts_buf)
                bitwise[f"{label}_split_suffix_after_{past}"] = bool(torch.equal(split,
                                                                                 whole[past:]))
    log(f"kernel bitwise {bitwise}")
    tuned = getattr(getattr(paged_triton, "_tuned_kernel", None), "cache", {}) or {}
    best = {str(key): str(config) for key, config in tuned.items()} or None
    return {"rows": rows, "bitwise": bitwise, "bitwise_all": all(bitwise.values()),
            "autotune_best": best,
            "shape": {"heads": heads, "kv_heads": kv_heads, "head_dim": dim, "dtype": "bf16"}}
