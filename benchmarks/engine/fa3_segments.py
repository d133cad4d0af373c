"""What cutting a row's keys into fixed segments costs FlashAttention 3, one layer on one GPU.

``kvtier.engine.paged_fa3_plan`` cuts every prompt row's keys every ``SEGMENT_TOKENS``
positions (8192): the full segments behind a row run as one non-causal FA3 launch over gathered
queries, the row's own segment as one causal launch, and ``paged_fa3_merge`` folds them. This
script times, over an 8B model's layer (32 heads, 8 KV heads, head_dim 128, bf16, pages of 64
tokens scattered in a pool): a 32k prompt's two 16k steps and hits' suffixes, eager, against
one unsplit FA3 launch of the same rows, with the host's plan building and each part (the
causal launch, the gather, the non-causal launch, the merge) apart; then a captured suffix
step's launches replayed from a CUDA graph with the two launches on two streams
(``paged_fa3.OVERLAP``) and on one, checking the replay gives the eager step's bits. Prints
one line per case and writes ``fa3_segments.json`` (with the machine's facts) under ``--out``.
Needs a Hopper GPU and vLLM with FA3 (``../shared/tools/vllm-gpu``'s kit). Main thread::

    PYTHONPATH=src:benchmarks/engine python3 benchmarks/engine/fa3_segments.py --out /tmp/seg
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

DEV, HEADS, KV_HEADS, DIM, PAGE, LENGTH = "cuda", 32, 8, 128, 64, 32768


def ms(fn: Any) -> float:
    """Device milliseconds of a call (``kernel_timing.device_ms``, 10 timed calls)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from kernel_timing import device_ms

    return device_ms(fn, 10, True)


def main() -> None:
    from kvtier.engine import paged, paged_fa3, paged_fa3_merge, paged_fa3_plan, paged_triton
    from kvtier.machine import write_report

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    torch.manual_seed(0)
    n_pages = LENGTH // PAGE
    pool = n_pages * 2 + 7
    kp = torch.randn(pool, PAGE, KV_HEADS, DIM, device=DEV).bfloat16()
    vp = torch.randn_like(kp)
    table = torch.randperm(pool)[:n_pages].int().to(DEV)[None]
    pages = table[0].tolist()
    q = torch.randn(LENGTH, HEADS, DIM, device=DEV).bfloat16()
    scale = DIM ** -0.5

    def batch(a: int, b: int) -> Any:
        row = paged.BatchRow(pages, a, [0] * (b - a), prompt=True)
        return paged_triton.TritonBatch([row], [0], PAGE, torch.device(DEV), fa3=True)

    def eager(a: int, b: int) -> dict[str, Any]:
        """Tokens ``a .. b`` as one eager step: the plan against one unsplit launch."""
        started = time.perf_counter()
        for _ in range(5):
            built = batch(a, b)
        torch.cuda.synchronize()
        host_ms = (time.perf_counter() - started) / 5 * 1e3
        qa = q[a:b].contiguous()
        unsplit = paged_fa3_plan.Launch(torch.tensor([0, b - a], dtype=torch.int32, device=DEV),
                                        torch.tensor([b], dtype=torch.int32, device=DEV),
                                        table, b - a)
        plan, out = built.fa3, torch.empty_like(qa)
        row: dict[str, Any] = {
            "host_build_ms": host_ms,
            "plan_attend_ms": ms(lambda: built.attend(qa, kp, vp, scale)),
            "unsplit_ms": ms(lambda: paged_fa3.launch(qa, kp, vp, unsplit, b, True, scale)),
            "own_ms": ms(lambda: paged_fa3.launch(qa, kp, vp, plan.own, plan.segment, True,
                                                  scale, out)),
            "passes": [full_pass(qa, plan, full, out) for full in plan.passes]}
        return row

    def full_pass(qa: torch.Tensor, plan: Any, full: Any, out: torch.Tensor) -> dict[str, Any]:
        _, lse = paged_fa3.launch(qa, kp, vp, plan.own, plan.segment, True, scale, out)
        gathered = qa.index_select(0, full.gather)
        part, part_lse = paged_fa3.launch(gathered, kp, vp, full.launch, plan.segment, False,
                                          scale)
        return {"rows": gathered.shape[0],
                "gather_ms": ms(lambda: qa.index_select(0, full.gather)),
                "full_ms": ms(lambda: paged_fa3.launch(gathered, kp, vp, full.launch,
                                                       plan.segment, False, scale)),
                "merge_ms": ms(lambda: paged_fa3_merge.merge(out, lse, part, part_lse,
                                                             full.rows, full.parts,
                                                             full.counts))}

    rows: dict[str, Any] = {}
    for a, b in ((0, 16384), (16384, LENGTH), (LENGTH - 17, LENGTH), (LENGTH - 128, LENGTH),
                 (20000 - 17, 20000)):
        rows[f"eager tokens {a}..{b}"] = eager(a, b)
        print(f"eager tokens {a}..{b}: {rows[f'eager tokens {a}..{b}']}", flush=True)
    for overlap in (True, False):
        paged_fa3.OVERLAP = overlap
        for bucket, new, end in ((32, 17, LENGTH), (32, 17, 20000), (128, 100, LENGTH),
                                 (8, 5, 4000)):
            static = paged_fa3_plan.StaticPlan(bucket, 65536, PAGE, torch.device(DEV))
            qs = torch.zeros(bucket, HEADS, DIM, dtype=torch.bfloat16, device=DEV)
            outs = torch.zeros_like(qs)
            row_ = paged.BatchRow(pages, end - new, [0] * new, prompt=True)
            started = time.perf_counter()
            for _ in range(20):
                static.fill(row_)
            fill_ms = (time.perf_counter() - started) / 20 * 1e3
            qs[:new].copy_(q[end - new:end])
            paged_fa3.attend(qs, kp, vp, static.plan, scale, outs)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                paged_fa3.attend(qs, kp, vp, static.plan, scale, outs)
            eager = batch(end - new, end).attend(q[end - new:end].contiguous(), kp, vp, scale)
            key = f"graph overlap={overlap} bucket {bucket} new {new} end {end}"
            rows[key] = {"replay_ms": ms(graph.replay), "host_fill_ms": fill_ms,
                         "equal_to_eager": bool(torch.equal(outs[:new], eager))}
            print(f"{key}: {rows[key]}", flush=True)
    paged_fa3.OVERLAP = True
    path = write_report(Path(args.out) / "fa3_segments.json", "fa3_segments", {"cases": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
