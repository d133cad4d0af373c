"""How fast causal prefill attention can run on this GPU: the ceiling kvtier's paged kernel aims at.

One layer's causal attention over one prompt (the preset's query and KV heads, keys and values
contiguous, nothing paged, no chunk-invariant sums) through:

- torch's flash ``scaled_dot_product_attention`` (FlashAttention 2 in torch's CUDA build);
- FlashAttention 3 from vLLM's ``vllm_flash_attn``, where vLLM is installed (vLLM's own prefill);
- a plain flash-attention Triton kernel written here (``dense_attention_kernel``: online
  softmax in fp32, exp2, unmasked blocks left of the diagonal, masked ones on it), under each
  ``--configs`` entry ``loads/ws/BLOCK_M/BLOCK_N/warps/stages``: keys and values read through
  pointers (``ptr``) or Hopper's tensor-memory accelerator (``tma``: host tensor
  descriptors), with Triton's warp specialization of the key loop on (1) or off (0).

It answers whether Triton on this GPU can reach FlashAttention 3's rate at all before
kvtier's paged kernel (``kvtier.engine.paged_triton``, about flash SDPA's rate:
``attention_sweep.py``) is rebuilt around those features. Prints TFLOP/s and each row's time
over flash SDPA's, with its largest difference from SDPA's output; writes
``attention_ceiling.json`` (with the machine's facts) under ``--out``. A config the installed
Triton cannot build is reported as an error row, not raised. Main thread.

    PYTHONPATH=src:benchmarks/engine python3 benchmarks/engine/attention_ceiling.py --out /tmp/ceil
    TRITON_INTERPRET=1 PYTHONPATH=src:benchmarks/engine python3 \\
        benchmarks/engine/attention_ceiling.py --device cpu --lengths 256 \\
        --configs ptr/0/64/32/4/2 --out /tmp/ceil
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path
from typing import Any

import triton
import triton.language as tl

DEFAULT_CONFIGS = ",".join([
    "ptr/0/128/64/8/3", "ptr/0/128/128/8/2", "ptr/0/128/64/4/3", "tma/0/128/64/8/3",
    "tma/0/128/128/8/2", "tma/0/128/128/8/3", "tma/1/128/64/4/3", "tma/1/128/128/4/2",
    "tma/1/128/128/8/2", "tma/1/128/64/8/3",
])


@triton.jit
def _attend(q, k, v, m_i, l_i, acc, rows, start_n, scale_log2,
            BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Fold one block of keys into the rows' running softmax (base 2)."""
    s = tl.dot(q, tl.trans(k)) * scale_log2
    if MASKED:
        keys = start_n + tl.arange(0, BLOCK_N)
        s = tl.where(rows[:, None] >= keys[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _load_kv(k_src, v_src, row, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
             TMA: tl.constexpr):
    """Rows ``[row, row + BLOCK_N)`` of K and V, through descriptors or pointers (one return
    after both branches: Triton builds the code after a constexpr branch that returns)."""
    if TMA:
        k, v = k_src.load([row, 0]), v_src.load([row, 0])
    else:
        offsets = (row + tl.arange(0, BLOCK_N))[:, None] * HEAD_DIM \
            + tl.arange(0, HEAD_DIM)[None, :]
        k, v = tl.load(k_src + offsets), tl.load(v_src + offsets)
    return k, v


@triton.jit
def dense_attention_kernel(q_src, k_src, v_src, out_ptr, n_tokens, n_rep, scale_log2,
                           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr):
    """One ``BLOCK_M`` query tile of one head. ``q_src``/``k_src``/``v_src``: tensor
    descriptors over ``[heads * tokens, HEAD_DIM]`` rows when ``TMA``, else pointers to
    those rows."""
    tile = tl.num_programs(0) - 1 - tl.program_id(0)        # the longest tiles first
    head = tl.program_id(1)
    kv_head = head // n_rep
    start_m = tile * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q_row, kv_row = head * n_tokens + start_m, kv_head * n_tokens
    if TMA:
        q = q_src.load([q_row, 0])
    else:
        q = tl.load(q_src + (q_row + tl.arange(0, BLOCK_M))[:, None] * HEAD_DIM + dims[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in tl.range(0, start_m, BLOCK_N, warp_specialize=WS):
        k, v = _load_kv(k_src, v_src, kv_row + start_n, HEAD_DIM, BLOCK_N, TMA)
        m_i, l_i, acc = _attend(q, k, v, m_i, l_i, acc, rows, start_n, scale_log2, BLOCK_N,
                                False)
    for start_n in tl.range(start_m, start_m + BLOCK_M, BLOCK_N):   # the causal diagonal
        k, v = _load_kv(k_src, v_src, kv_row + start_n, HEAD_DIM, BLOCK_N, TMA)
        m_i, l_i, acc = _attend(q, k, v, m_i, l_i, acc, rows, start_n, scale_log2, BLOCK_N,
                                True)
    acc = acc / l_i[:, None]
    out_rows = head * n_tokens + rows
    tl.store(out_ptr + out_rows[:, None] * HEAD_DIM + dims[None, :], acc.to(out_ptr.dtype.element_ty))


def parse_config(text: str) -> dict[str, Any]:
    fields = text.split("/")
    if len(fields) != 6 or fields[0] not in ("ptr", "tma") or not all(
            f.isdigit() for f in fields[1:]):
        raise ValueError(f"config {text!r}: want loads/ws/BLOCK_M/BLOCK_N/warps/stages "
                         "(loads ptr or tma, then five integers)")
    block_m, block_n, warps, stages = (int(f) for f in fields[2:])
    if block_m % block_n:
        raise ValueError(f"config {text!r}: BLOCK_M must be a multiple of BLOCK_N")
    return {"name": text, "tma": fields[0] == "tma", "ws": fields[1] == "1", "block_m": block_m,
            "block_n": block_n, "num_warps": warps, "num_stages": stages}


def dense_attention(q: Any, k: Any, v: Any, scale: float, config: dict[str, Any]) -> Any:
    """``q`` ``[heads, tokens, dim]``, ``k``/``v`` ``[kv_heads, tokens, dim]`` (contiguous;
    tokens a multiple of ``BLOCK_M``); returns ``[heads, tokens, dim]``."""
    import torch

    heads, tokens, dim = q.shape
    out = torch.empty_like(q)
    bm, bn = config["block_m"], config["block_n"]
    if config["tma"]:
        from triton.tools.tensor_descriptor import TensorDescriptor

        srcs = (TensorDescriptor.from_tensor(q.view(-1, dim), [bm, dim]),
                TensorDescriptor.from_tensor(k.view(-1, dim), [bn, dim]),
                TensorDescriptor.from_tensor(v.view(-1, dim), [bn, dim]))
    else:
        srcs = (q, k, v)
    grid = (tokens // bm, heads)
    dense_attention_kernel[grid](*srcs, out, tokens, heads // k.shape[0],
                                 scale * 1.4426950408889634, HEAD_DIM=dim, BLOCK_M=bm,
                                 BLOCK_N=bn, TMA=config["tma"], WS=config["ws"],
                                 num_warps=config["num_warps"], num_stages=config["num_stages"])
    return out


def fa3() -> Any:
    """vLLM's FlashAttention 3 varlen call, or None where vLLM (or its FA3) is missing."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
        from vllm.vllm_flash_attn.flash_attn_interface import is_fa_version_supported
    except Exception:
        return None
    return flash_attn_varlen_func if is_fa_version_supported(3) else None


def main() -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernel_timing import causal_tflops, device_ms, preset_heads
    from kvtier.machine import format_table, write_report

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default="llama3-8b-shape")
    p.add_argument("--device", default="cuda")
    p.add_argument("--lengths", default="4096,32768")
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    heads, kv_heads, dim = preset_heads(args.preset)
    scale = dim ** -0.5
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    # bf16 on the GPU; fp32 in the CPU dry run (the interpreter's tl.dot mishandles bf16)
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    flash3 = fa3() if cuda else None
    def one_length(length: int) -> list[dict[str, Any]]:
        q = torch.randn((heads, length, dim), generator=gen, device=device, dtype=dtype)
        k = torch.randn((kv_heads, length, dim), generator=gen, device=device, dtype=dtype)
        v = torch.randn_like(k)
        rep = heads // kv_heads

        def sdpa() -> Any:
            backend = SDPBackend.FLASH_ATTENTION if cuda else SDPBackend.MATH
            kk, vv = (k, v) if cuda else (k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0))
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q[None], kk[None], vv[None], is_causal=True,
                                                      scale=scale, enable_gqa=cuda)[0]

        want = sdpa()
        base = device_ms(sdpa, args.iters, cuda)

        def row(kernel: str, ms: float, got: Any) -> dict[str, Any]:
            return {"tokens": length, "kernel": kernel, "ms": round(ms, 3),
                    "TFLOP/s": causal_tflops(heads, dim, length, ms),
                    "x SDPA time": round(ms / base, 3),
                    "max |diff|": round((got.float() - want.float()).abs().max().item(), 4)}

        out = [row("flash SDPA (torch)", base, want)]
        if flash3 is not None:
            qt, kt, vt = (t.transpose(0, 1).contiguous() for t in (q, k, v))
            cu = torch.tensor([0, length], dtype=torch.int32, device=device)

            def fa3_call() -> Any:
                return flash3(qt, kt, vt, max_seqlen_q=length, cu_seqlens_q=cu,
                              max_seqlen_k=length, cu_seqlens_k=cu, softmax_scale=scale,
                              causal=True, fa_version=3).transpose(0, 1)

            out.append(row("FlashAttention 3 (vLLM)", device_ms(fa3_call, args.iters, cuda),
                           fa3_call()))
        for text in args.configs.split(","):
            launch = parse_config(text)
            try:
                got = dense_attention(q, k, v, scale, launch)
                ms = device_ms(partial(dense_attention, q, k, v, scale, launch), args.iters, cuda)
            except Exception as exc:     # a config this Triton cannot build: a row, not a stop
                out.append({"tokens": length, "kernel": f"triton {text}", "ms": None,
                            "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
                continue
            out.append(row(f"triton {text}", ms, got))
        return out

    rows = [r for length in args.lengths.split(",") for r in one_length(int(length))]
    columns = ["tokens", "kernel", "ms", "TFLOP/s", "x SDPA time", "max |diff|"]
    print(format_table(columns, [[row.get(c) for c in columns] for row in rows]))
    for row in rows:
        if row.get("error"):
            print(f"{row['tokens']} {row['kernel']}: {row['error']}")
    path = write_report(Path(args.out) / "attention_ceiling.json", "attention_ceiling",
                        {"args": vars(args), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
