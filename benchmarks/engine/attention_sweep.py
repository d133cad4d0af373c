"""The paged prefill kernel's launch choices, timed side by side with flash SDPA on one GPU.

For each ``--lengths`` entry, one layer's causal prefill (the preset's heads, pages of
``--page`` tokens scattered in the pool; prompts over ``--step`` tokens in steps of that
many, as the engine's scheduler cuts them) through ``kvtier.engine.paged_triton`` under each
``--configs`` entry, and through torch's flash ``scaled_dot_product_attention`` on the same
queries and keys laid out contiguously (the peer's rate on this GPU). A config is
``BLOCK_N/CHUNK/warps/stages``: keys a block, keys a chunk summed from scratch, and the
launch's warps and software-pipeline stages; ``/tma`` or ``/ptr`` after them reads pages of
whole blocks through tensor descriptors or pointers (``paged_triton.use_tma``; without
either, what the engine would do); ``/tmakv`` reads keys and values through descriptors but
queries through pointers (``paged_triton.query_box`` off: the form before queries had their
own descriptor). Prints TFLOP/s
of the causal work, each config's time over flash SDPA's and its largest difference from
SDPA's output; writes
``attention_sweep.json`` (with the machine's facts) under ``--out``. A config other than the
engine's changes how sums are cut, so it would need the split launch changed with it (the
numerics contract in ``kvtier.engine.paged_tiles``); this script only times it. Main thread.

    PYTHONPATH=src python3 benchmarks/engine/attention_sweep.py --out /tmp/sweep
    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/engine/attention_sweep.py --device cpu \\
        --lengths 256 --step 128 --configs 64/128/8/2,128/256/8/2 --out /tmp/sweep
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

DEFAULT_CONFIGS = ",".join([
    "64/1024/8/2", "64/1024/8/3", "64/1024/8/4", "64/1024/8/2/tma", "64/1024/8/3/tma",
    "64/2048/8/3", "128/1024/8/2", "128/1024/8/3", "64/1024/4/3",
])


def parse_config(text: str) -> dict[str, Any]:
    fields = text.split("/")
    loads = fields.pop() if len(fields) == 5 and fields[-1] in ("ptr", "tma", "tmakv") else ""
    if len(fields) != 4 or not all(f.isdigit() for f in fields):
        raise ValueError(f"config {text!r}: want BLOCK_N/CHUNK/warps/stages, four integers, "
                         "then optionally /ptr (pointer loads), /tma (tensor descriptors) or "
                         "/tmakv (descriptors for keys and values only)")
    block_n, chunk, warps, stages = (int(f) for f in fields)
    return {"name": text, "block_n": block_n, "chunk": chunk, "num_warps": warps,
            "num_stages": stages, "loads": loads}


def main() -> None:
    import torch
    import torch.nn.functional as F

    from kernel_timing import causal_tflops, device_ms, preset_heads
    from kvtier.engine import paged_triton
    from kvtier.machine import format_table, write_report

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default="llama3-8b-shape")
    p.add_argument("--device", default="cuda")
    p.add_argument("--lengths", default="4096,32768")
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--step", type=int, default=8192, help="prompt tokens a prefill step runs")
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    heads, kv_heads, dim = preset_heads(args.preset)
    n_rep, scale = heads // kv_heads, dim ** -0.5
    device, dtype = torch.device(args.device), torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    cuda = device.type == "cuda"

    def timed(fn: Any) -> float:
        return device_ms(fn, args.iters, cuda)

    def tflops(length: int, ms: float) -> float:
        return causal_tflops(heads, dim, length, ms)

    def one_length(length: int) -> list[dict[str, Any]]:
        pages = -(-length // args.page)
        k = torch.randn((pages, args.page, kv_heads, dim), generator=gen, device=device,
                        dtype=dtype)
        v = torch.randn_like(k)
        table = torch.randperm(pages, generator=gen, device=device).to(torch.int32)[None]
        q = torch.randn((length, heads, dim), generator=gen, device=device, dtype=dtype)
        slots = (table[0].long()[:, None] * args.page
                 + torch.arange(args.page, device=device)).reshape(-1)[:length]
        k4 = k.reshape(-1, kv_heads, dim)[slots].transpose(0, 1)[None]
        v4 = v.reshape(-1, kv_heads, dim)[slots].transpose(0, 1)[None]
        q4 = q.transpose(0, 1)[None]

        def sdpa() -> Any:
            return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale,
                                                  enable_gqa=True)
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                want, sdpa_ms = sdpa(), timed(sdpa)
        except RuntimeError:   # no flash backend here (the CPU): whatever SDPA picks
            want, sdpa_ms = sdpa(), timed(sdpa)
        want = want[0].transpose(0, 1)
        rows = [{"tokens": length, "config": "flash SDPA (torch)", "ms": round(sdpa_ms, 3),
                 "tflops": tflops(length, sdpa_ms), "over_sdpa": 1.0, "max_diff": 0.0}]
        step = min(args.step, length)
        per = max(1, paged_triton.MAX_ROWS // n_rep)
        tiles = [torch.as_tensor([(0, off, min(per, min(s + step, length) - off), off)
                                  for off in range(s, min(s + step, length), per)],
                                 dtype=torch.int32, device=device) for s in range(0, length, step)]
        out = torch.empty_like(q)
        for text in args.configs.split(","):
            c = parse_config(text)
            launch = {"num_warps": c["num_warps"], "num_stages": c["num_stages"]} if cuda else None

            def run(c: dict[str, Any] = c, launch: dict[str, int] | None = launch) -> None:
                chosen = paged_triton.GPU_DESCRIPTORS, paged_triton.use_tma, \
                    paged_triton.query_box
                if c["loads"] in ("tma", "tmakv"):     # descriptors on GPUs for this config only
                    paged_triton.GPU_DESCRIPTORS = True
                elif c["loads"] == "ptr":   # and off
                    paged_triton.use_tma = lambda *_: False
                if c["loads"] == "tmakv":   # queries through pointers
                    paged_triton.query_box = lambda *_: 0
                try:
                    for t in tiles:
                        paged_triton.paged_attention(q, k, v, table, t, scale, per, out,
                                                     chunk=c["chunk"], block_n=c["block_n"],
                                                     launch=launch)
                finally:
                    (paged_triton.GPU_DESCRIPTORS, paged_triton.use_tma,
                     paged_triton.query_box) = chosen
            try:
                ms = timed(run)
            except Exception as exc:   # a config this GPU cannot hold (shared memory)
                rows.append({"tokens": length, "config": text, "error": repr(exc)[:200]})
                print(f"{length} {text}: {exc!r}"[:300], flush=True)
                continue
            diff = (out.float() - want.float()).abs().max().item()
            rows.append({"tokens": length, "config": text, "ms": round(ms, 3),
                         "tflops": tflops(length, ms), "over_sdpa": round(ms / sdpa_ms, 3),
                         "max_diff": round(diff, 4)})
            print(f"{length} {text}: {ms:.2f} ms", flush=True)
        return rows

    rows: list[dict[str, Any]] = []
    for length in [int(x) for x in args.lengths.split(",") if x]:
        rows += one_length(length)
        if cuda:
            torch.cuda.empty_cache()
    print(format_table(["tokens", "config (block_n/chunk/warps/stages)", "ms", "TFLOP/s",
                        "x SDPA time", "max |diff|"],
                       [[r["tokens"], r["config"], r.get("ms", "error"), r.get("tflops", ""),
                         r.get("over_sdpa", ""), r.get("max_diff", "")] for r in rows]))
    path = write_report(Path(args.out) / "attention_sweep.json", "attention_sweep",
                        {"args": vars(args), "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
