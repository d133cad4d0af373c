"""FlashAttention 3 (vLLM's ``vllm.vllm_flash_attn``) over kvtier's device-pool layout on one GPU.

Checks what ``kvtier.engine.paged_fa3`` relies on and times it beside kvtier's Triton flash
kernel: one layer's causal attention over pages ``[pages, page_size, kv_heads, head_dim]``
scattered in a pool, computed whole, in steps of 16384 / 8192 / 5000 / 4096 tokens and as a
suffix of 1 .. 1000 tokens (at the end and in the middle of a 32k prompt), in a batch beside a
decode or a chunk of another row, and replayed from a CUDA graph at other lengths: each must
give the whole prompt's bits (``True, 0.0``: equal, largest difference). Then other shapes
(head_dim 32 / 64 / 128, GQA 2 / 4 / 7, pages of 1 to 256 tokens, fp16) and the time of one
4k and 32k layer (FA3, then the Triton kernel) and of a suffix over 32k keys. kvtier's own
plan (``paged_fa3_plan``: keys cut at fixed positions, segments merged) is checked and timed
the same way (``FA3_PROBE_PLAN_ONLY=1`` skips the Triton and unsplit timings). Prints a list
and writes ``fa3_probe.json`` (with the machine's facts) under ``--out``. Needs a Hopper GPU
and vLLM with FA3 (``../shared/tools/vllm-gpu``'s kit). Main thread::

    PYTHONPATH=src python3 benchmarks/engine/fa3_probe.py --out /tmp/fa3
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

DEV = "cuda"


class Shape:
    """Heads, KV heads, head_dim and dtype of one set of checks."""

    def __init__(self, heads: int = 32, kv_heads: int = 8, dim: int = 128,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.heads, self.kv_heads, self.dim, self.dtype = heads, kv_heads, dim, dtype
        self.scale = dim ** -0.5


def fa(shape: Shape, q, kp, vp, table, cu_q, used, max_q: int, max_k: int, out=None):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(q, kp, vp, max_q, cu_q, max_k, seqused_k=used,
                                  block_table=table, causal=True, softmax_scale=shape.scale,
                                  num_splits=1, fa_version=3, out=out)


def i32(values: list[int]) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int32, device=DEV)


def setup(shape: Shape, length: int, page: int, extra: int = 7):
    """Queries for ``length`` tokens and their pages scattered over a pool twice their size."""
    n_pages = -(-length // page)
    pool_pages = n_pages * 2 + extra
    kp = torch.randn(pool_pages, page, shape.kv_heads, shape.dim, device=DEV).to(shape.dtype)
    vp = torch.randn(pool_pages, page, shape.kv_heads, shape.dim, device=DEV).to(shape.dtype)
    table = torch.randperm(pool_pages)[:n_pages].to(torch.int32).to(DEV)[None]
    q = torch.randn(length, shape.heads, shape.dim, device=DEV).to(shape.dtype)
    return q, kp, vp, table


def piece(shape: Shape, q, kp, vp, table, a: int, b: int, max_k: int | None = None):
    """Tokens ``a .. b`` of the prompt as one row over its first ``b`` keys."""
    n = b - a
    return fa(shape, q[a:b].contiguous(), kp, vp, table, i32([0, n]), i32([b]), n, max_k or b)


def same(x: torch.Tensor, y: torch.Tensor) -> tuple[bool, float]:
    return bool(torch.equal(x, y)), float((x.float() - y.float()).abs().max())


def timeit(fn: Callable[[], Any]) -> float:
    """Milliseconds a call (``kernel_timing.device_ms``: one warm-up, then 5 timed calls)."""
    from kernel_timing import device_ms

    return device_ms(fn, 5, True)


def checks_32k(page: int, checks: dict[str, Any]) -> tuple[Any, ...]:
    shape, length = Shape(), 32768
    q, kp, vp, table = setup(shape, length, page)
    whole = piece(shape, q, kp, vp, table, 0, length)
    for step in (16384, 8192, 5000, 4096):
        outs = [piece(shape, q, kp, vp, table, a, min(a + step, length))
                for a in range(0, length, step)]
        checks[f"p{page} steps {step} == whole"] = same(torch.cat(outs), whole)
    for n in (1, 17, 100, 300, 1000):
        checks[f"p{page} suffix {n} == whole"] = same(
            piece(shape, q, kp, vp, table, length - n, length), whole[length - n:])
        checks[f"p{page} suffix {n} mid (ends 20000) == whole"] = same(
            piece(shape, q, kp, vp, table, 20000 - n, 20000), whole[20000 - n:20000])
    checks[f"p{page} suffix 17 max_k 65536 == whole"] = same(
        piece(shape, q, kp, vp, table, length - 17, length, max_k=65536), whole[length - 17:])
    both = torch.cat([q[length - 17:], q[8192:12288]]).contiguous()
    out = fa(shape, both, kp, vp, torch.cat([table, table]), i32([0, 17, 17 + 4096]),
             i32([length, 12288]), 4096, length)
    checks[f"p{page} batch(suffix17, chunk4096) == whole"] = same(
        out, torch.cat([whole[length - 17:], whole[8192:12288]]))
    mixed = torch.cat([q[100:101], q[length - 1:], q[0:2048]]).contiguous()
    out = fa(shape, mixed, kp, vp, torch.cat([table] * 3), i32([0, 1, 2, 2050]),
             i32([101, length, 2048]), 2048, length)
    checks[f"p{page} batch(decode,decode,prompt2048) == whole"] = same(
        out, torch.cat([whole[100:101], whole[length - 1:], whole[0:2048]]))
    return shape, q, kp, vp, table, whole


def graph_checks(shape: Shape, q, kp, vp, table, whole, checks: dict[str, Any]) -> None:
    """A 17-token suffix captured once, replayed with other lengths read from the device."""
    n, length = 17, q.shape[0]
    qb, used, cu = q[length - n:].clone(), i32([length]), i32([0, n])
    ob = torch.empty_like(qb)
    fa(shape, qb, kp, vp, table, cu, used, n, length, out=ob)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fa(shape, qb, kp, vp, table, cu, used, n, length, out=ob)
    for end in (length, 20000, 777):
        qb.copy_(q[end - n:end])
        used.fill_(end)
        graph.replay()
        torch.cuda.synchronize()
        checks[f"graph suffix 17 ending {end} == whole"] = same(ob, whole[end - n:end])


def timings(q, kp, vp, table, checks: dict[str, Any], times: dict[str, float]) -> None:
    from kvtier.engine import paged_triton

    shape = Shape()
    for length in (4096, 32768):
        q2, kp2, vp2, t2 = setup(shape, length, 64)
        times[f"fa3 whole {length}"] = timeit(
            lambda q2=q2, kp2=kp2, vp2=vp2, t2=t2, n=length: piece(shape, q2, kp2, vp2, t2, 0, n))
        per = paged_triton.tokens_per_tile(shape.heads // shape.kv_heads)
        blocks = torch.as_tensor([(0, off, min(per, length - off), off)
                                  for off in range(0, length, per)], dtype=torch.int32,
                                 device=DEV)
        out = torch.empty_like(q2)
        times[f"kvtier triton whole {length}"] = timeit(
            lambda q2=q2, kp2=kp2, vp2=vp2, t2=t2, blocks=blocks, out=out, per=per:
            paged_triton.paged_attention(q2, kp2, vp2, t2, blocks, shape.scale, per, out))
        checks[f"triton vs fa3 max diff {length}"] = same(
            out, piece(shape, q2, kp2, vp2, t2, 0, length))
    length = q.shape[0]
    for n in (1, 17, 128, 1024):
        times[f"fa3 suffix {n} over {length}"] = timeit(
            lambda n=n: piece(shape, q, kp, vp, table, length - n, length))


def segmented(q, kp, vp, table, checks: dict[str, Any], times: dict[str, float]) -> None:
    """kvtier's FA3 plan (keys cut every ``paged_fa3_plan.segment_for`` positions, segments
    merged): the same bits whole, in steps and as suffixes; how far from one unsplit launch;
    the time of a 32k prompt's two 16k steps and of a 17-token suffix over 32k keys."""
    from kvtier.engine import paged, paged_triton

    shape, length, page = Shape(), q.shape[0], kp.shape[1]
    pages = table[0].tolist()

    def run(a: int, b: int) -> torch.Tensor:
        batch = paged_triton.TritonBatch([paged.BatchRow(pages, a, [0] * (b - a), prompt=True)],
                                         [0], page, torch.device(DEV), fa3=True)
        return batch.attend(q[a:b], kp, vp, shape.scale)

    whole = run(0, length)
    checks["plan whole vs one unsplit launch (max diff)"] = same(
        whole, piece(shape, q, kp, vp, table, 0, length))
    for step in (16384, 5000):
        outs = [run(a, min(a + step, length)) for a in range(0, length, step)]
        checks[f"plan steps {step} == plan whole"] = same(torch.cat(outs), whole)
    for n in (1, 17, 300):
        for end in (length, 20000, 8192 + 5):
            checks[f"plan suffix {n} ending {end} == plan whole"] = same(run(end - n, end),
                                                                         whole[end - n:end])
    for a, b in ((0, 16384), (16384, length), (length - 17, length)):
        times[f"plan fa3 tokens {a}..{b}"] = timeit(lambda a=a, b=b: run(a, b))
        times[f"unsplit fa3 tokens {a}..{b}"] = timeit(
            lambda a=a, b=b: piece(shape, q, kp, vp, table, a, b))


def shape_check(shape: Shape, page: int, length: int) -> dict[str, Any]:
    """Whole against 1000-token steps and suffixes of 1, 9, 77 and 300 tokens."""
    try:
        q, kp, vp, table = setup(shape, length, page)
        whole = piece(shape, q, kp, vp, table, 0, length)
        steps = [piece(shape, q, kp, vp, table, a, min(a + 1000, length))
                 for a in range(0, length, 1000)]
        ok = [same(torch.cat(steps), whole)]
        for n in (1, 9, 77, 300):
            ok.append(same(piece(shape, q, kp, vp, table, length - n, length), whole[length - n:]))
        return {"all_equal": all(o[0] for o in ok), "detail": ok}
    except Exception as exc:   # a shape FA3 refuses: recorded, the other checks go on
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def main() -> None:
    from kvtier.machine import write_report

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    torch.manual_seed(0)
    checks: dict[str, Any] = {}
    times: dict[str, float] = {}
    for page in (64, 16):
        shape, q, kp, vp, table, whole = checks_32k(page, checks)
        if page == 64:
            graph_checks(shape, q, kp, vp, table, whole, checks)
            segmented(q, kp, vp, table, checks, times)
            if not os.environ.get("FA3_PROBE_PLAN_ONLY"):
                timings(q, kp, vp, table, checks, times)
        del q, kp, vp, whole
    for heads, kv_heads, dim, page, length, dtype in (
            (4, 2, 32, 16, 3000, torch.bfloat16), (4, 2, 64, 16, 3000, torch.bfloat16),
            (28, 4, 128, 64, 5000, torch.bfloat16), (32, 8, 128, 256, 9000, torch.bfloat16),
            (32, 8, 128, 128, 9000, torch.bfloat16), (32, 8, 128, 64, 5000, torch.float16),
            (32, 8, 128, 1, 2000, torch.bfloat16)):
        key = f"shape heads={heads} kv_heads={kv_heads} dim={dim} page={page} L={length} {dtype}"
        checks[key] = shape_check(Shape(heads, kv_heads, dim, dtype), page, length)
    for k, v in checks.items():
        print(f"{k:70s} {v}")
    for k, t in times.items():
        print(f"{k:70s} {t:.3f} ms")
    path = write_report(Path(args.out) / "fa3_probe.json", "fa3_probe",
                        {"checks": checks, "times_ms": times})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
