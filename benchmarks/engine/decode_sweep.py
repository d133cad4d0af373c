"""Split-KV decode attention (``paged_split``) alone on the GPU: one layer's decode rows over the
device pool's pages, for several tile shapes of its chunk kernel, timed with CUDA events.

Each ``--configs`` entry is ``BLOCK_N/num_warps/num_stages`` (keys a program loads per
iteration, warps per program, software-pipelining stages); the first (by default the engine's,
``paged_split.BLOCK_N`` and ``NUM_STAGES``, 4 warps) is the reference whose output the others
are compared with (max abs difference: another ``BLOCK_N`` sums a chunk's keys in another
order, so small differences are expected; warps and stages change no sum; the chunk size and
the merge are the same). Rows are ``--batch`` sequences of ``--keys`` keys over pages scattered at random in a
pool of ``--page-size``-token pages (llama3-8b's 32/8 heads x 128 by default). Reported per
config: ms per launch pair (chunks + merge), the K and V bytes read over that time (GB/s), and
the ratio to the reference. Prints a table and writes ``decode_sweep.json`` (with the machine's
facts) under ``--out``. Main thread.

    PYTHONPATH=src python3 benchmarks/engine/decode_sweep.py --out /tmp/ds
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--keys", type=int, default=5108)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--configs", default="32/4/2,32/4/3,64/4/2,64/4/3,64/8/3,128/8/3,128/4/2")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--device", default="cuda",
                   help="cpu: a dry run under TRITON_INTERPRET=1 (tiny sizes, no timing worth reading)")
    args = p.parse_args()

    import triton

    from kernel_timing import device_ms
    from kvtier.engine import paged_split
    from kvtier.machine import format_table, machine_info

    dev, dtype = torch.device(args.device), torch.bfloat16
    per_seq = -(-args.keys // args.page_size)
    pages = args.batch * per_seq
    g = torch.Generator(device="cpu").manual_seed(0)
    k = torch.randn(pages, args.page_size, args.kv_heads, args.head_dim, generator=g).to(dev, dtype)
    v = torch.randn(pages, args.page_size, args.kv_heads, args.head_dim, generator=g).to(dev, dtype)
    table = torch.randperm(pages, generator=g).view(args.batch, per_seq).to(dev, torch.int32)
    q = torch.randn(args.batch, args.heads, args.head_dim, generator=g).to(dev, dtype)
    decodes = torch.tensor([[i, i, args.keys] for i in range(args.batch)], dtype=torch.int32,
                           device=dev)
    n_splits = paged_split.splits_for(args.keys)
    n_rep = args.heads // args.kv_heads
    scale = args.head_dim ** -0.5 * 1.4426950408889634
    bytes_read = 2 * args.batch * args.keys * args.kv_heads * args.head_dim * 2

    def launch(block_n: int, warps: int, stages: int, out: torch.Tensor) -> None:
        partial = torch.empty((args.batch, args.heads, n_splits), dtype=torch.float32, device=dev)
        sums = torch.empty_like(partial)
        acc = torch.empty((args.batch, args.heads, n_splits, args.head_dim), dtype=torch.float32,
                          device=dev)
        paged_split.split_decode_kernel[(args.batch, args.kv_heads, n_splits)](
            q, k, v, partial, sums, acc, table, decodes, q.stride(0), q.stride(1), k.stride(1),
            k.stride(2), table.shape[1], n_rep, args.page_size, scale, n_splits,
            HEAD_DIM=args.head_dim, BLOCK_R=max(16, triton.next_power_of_2(n_rep)),
            BLOCK_N=block_n, CHUNK=paged_split.CHUNK_TOKENS, PRECISION="tf32",
            num_warps=warps, num_stages=stages)
        paged_split.merge_kernel[(args.batch, args.heads)](
            partial, sums, acc, out, decodes, n_splits, HEAD_DIM=args.head_dim,
            CHUNK=paged_split.CHUNK_TOKENS)

    rows: list[dict[str, Any]] = []
    reference = None
    for config in args.configs.split(","):
        block_n, warps, stages = (int(x) for x in config.split("/"))
        out = torch.zeros_like(q)
        try:
            launch(block_n, warps, stages, out)          # compiles it
            ms = device_ms(lambda c=(block_n, warps, stages, out): launch(*c), args.iters,
                           dev.type == "cuda")
        except Exception as exc:      # a config the compiler or the device refuses
            rows.append({"config": config, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        if reference is None:
            reference = (out.clone(), ms)
        rows.append({"config": config, "ms": round(ms, 4),
                     "gb_s": round(bytes_read / ms / 1e6, 1),
                     "vs_first": round(ms / reference[1], 3),
                     "max_abs_diff": float((out.float() - reference[0].float()).abs().max())})
    cols = ["config", "ms", "gb_s", "vs_first", "max_abs_diff", "error"]
    table = format_table(cols, [[row.get(c) for c in cols] for row in rows])
    print(f"split decode, {args.batch} rows x {args.keys} keys, page {args.page_size}, "
          f"{args.heads}/{args.kv_heads} heads x {args.head_dim}, bf16; config = "
          f"BLOCK_N/warps/stages, first = the engine's")
    print(table)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "decode_sweep.json").write_text(json.dumps(
        {"args": vars(args), "rows": rows, "machine": machine_info()}, indent=2))


if __name__ == "__main__":
    main()
