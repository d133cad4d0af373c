"""FlashAttention 3 over the device pool's pages: the prefill attention on Hopper where it is installed.

Owns ``choose`` (which kernels read the pool in a forward: ``engine.prefill_attention``
resolved against the GPU, the dtype, the model and what is importable), ``Fa3Rows`` (one
step's FA3 arguments: a segment per row and the keys it sees) and ``attend``
(one FA3 launch over the device pool's pages, ``[pages, page_size, kv_heads, head_dim]``,
read in place as FA3's paged key/value cache).

Why: at 32k tokens the prefill is attention-bound. FA3, which vLLM runs on Hopper, computes a
32k causal layer of an 8B model over kvtier's pool in 13.3 ms on an H100 where kvtier's Triton
flash kernel takes 19.8 ms (``benchmarks/results/fa3_probe_h100.txt``): warp-specialized
producer and consumer warps that Triton 3.6 does not give. FA3 comes from vLLM's wheel
(``vllm.vllm_flash_attn``, FA3 built in); without it, on other GPUs, in fp32, at head
dimensions other than 128 or in the deterministic mode the Triton kernels serve
(``paged_triton``, ``paged_prefill_split``).

The numerics contract (a hit's tokens are a recompute's) holds when every prefill-shaped
attention of the engine runs here: the batched steps' prompt rows (``paged.PagedBatch``) and
the captured steps of a hit's suffix (``suffix_step``). FA3 is called without splitting a
row's keys (``num_splits=1``): each query row then sums its keys in fixed blocks counted from
key 0, from its own last block down, whatever tile the row sits in, whatever else the launch
holds and however the prompt was cut into steps. That was measured, not assumed, on an H100
(``tests/test_paged_fa3_gpu.py``: a prompt whole, in steps and as a suffix give the same bits,
alone, beside other rows and from a graph, at head_dim 128, pages of 1 to 256 tokens, GQA 4
and 7, bf16 and fp16); at head_dim 64 it did not hold (``HEAD_DIMS``). The cost: a hit's
short suffix over a long past runs on a few programs per KV head (0.43 ms a layer for 17
tokens over 32k keys): a 32k device hit took 22.5 ms against 13.6 ms with the Triton kernels'
split launch (``benchmarks/results/engine_vs_vllm_h100_fa3.txt``, ``..._fa3_triton.txt``).
A row of one new token (a decode) gets an empty key range here (FA3 writes zeros, reading
nothing) and its attention from the split-KV decode kernel after. Engine thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

#: ``engine.prefill_attention``'s values.
CHOICES = ("auto", "triton", "fa3")
#: Head dimensions where FA3 was measured to keep the numerics contract (an H100, vLLM 0.26's
#: build, ``tests/test_paged_fa3_gpu.py``). At 64 (and 32) a prompt's last rows came out with
#: other bits as a 9- or 77-token suffix than computed whole, so those models keep the Triton
#: kernels; 96, 192 and 256 were not measured.
HEAD_DIMS = (128,)
DTYPES = (torch.bfloat16, torch.float16)

#: FA3's varlen entry once found (False: looked for and missing; None: not looked for yet).
_KERNEL: Callable[..., Any] | bool | None = None
#: Why FA3 is missing, once looked for.
_MISSING = ""


def kernel() -> Callable[..., Any] | None:
    """FA3's ``flash_attn_varlen_func`` bound to version 3, or None (``missing()`` says why)."""
    global _KERNEL, _MISSING
    if _KERNEL is None:
        try:
            from vllm.vllm_flash_attn import flash_attn_varlen_func, is_fa_version_supported
        except Exception as exc:   # not installed, or built without CUDA kernels
            _KERNEL, _MISSING = False, f"vllm.vllm_flash_attn: {type(exc).__name__}: {exc}"
        else:
            if is_fa_version_supported(3):
                def fa3(*args: Any, **kwargs: Any) -> Any:
                    return flash_attn_varlen_func(*args, fa_version=3, **kwargs)
                _KERNEL = fa3
            else:
                _KERNEL, _MISSING = False, "vllm.vllm_flash_attn has no FA3 for this GPU"
    return _KERNEL or None


def missing() -> str:
    return _MISSING


def choose(setting: str, device: torch.device, dtype: torch.dtype, head_dim: int,
           deterministic: bool) -> tuple[str, str]:
    """(backend, why): ``torch`` off CUDA, ``fa3`` where ``setting`` allows it and it can
    serve this model, ``triton`` otherwise. ``setting`` ``fa3`` that cannot be met is
    logged as a warning (the engine still starts, on the Triton kernels)."""
    if setting not in CHOICES:
        raise ValueError(f"engine.prefill_attention must be one of {', '.join(CHOICES)}, "
                         f"got {setting!r}")
    if device.type != "cuda":
        return "torch", "not on CUDA"
    if setting == "triton":
        return "triton", "engine.prefill_attention triton"
    why = _unfit(device, dtype, head_dim, deterministic)
    if why is None and kernel() is None:
        why = missing()
    if why is None:
        why = _refused(device, dtype, head_dim)
    if why is not None:
        if setting == "fa3":
            log.warning("engine.prefill_attention fa3: not available (%s); the Triton kernels "
                        "serve the prefill", why)
        return "triton", why
    return "fa3", "FlashAttention 3 (vllm.vllm_flash_attn)"


def _unfit(device: torch.device, dtype: torch.dtype, head_dim: int,
           deterministic: bool) -> str | None:
    if deterministic:
        return "engine.deterministic keeps its own kernels"
    if dtype not in DTYPES:
        return f"FA3 computes bf16/fp16, not {dtype}"
    if head_dim not in HEAD_DIMS:
        return f"FA3 is used at head_dim {', '.join(map(str, HEAD_DIMS))} only, not {head_dim}"
    major, _ = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"FA3 is built for Hopper (compute capability 9.x), this GPU is {major}.x"
    return None


def _refused(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why one small launch of this shape fails here (a build without this head_dim or
    GPU), or None: found at load rather than in a request's step."""
    try:
        pages = torch.zeros((2, 16, 1, head_dim), dtype=dtype, device=device)
        query = torch.zeros((3, 2, head_dim), dtype=dtype, device=device)
        as_int = {"dtype": torch.int32, "device": device}
        attend(query, pages, pages, torch.tensor([[1, 0]], **as_int),
               torch.tensor([0, 3], **as_int), torch.tensor([20], **as_int), 3, 32,
               head_dim ** -0.5, torch.empty_like(query))
        torch.cuda.synchronize(device)
    except Exception as exc:   # any failure of the trial launch: the Triton kernels serve
        return f"a trial FA3 launch failed: {type(exc).__name__}: {exc}".splitlines()[0]
    return None


class Fa3Rows:
    """One step's rows as FA3 segments: ``cu_q`` (each row's first query in the packed
    tokens, then the total), ``seqused`` (the keys each row sees: its end, 0 for a decode
    row), the longest row's queries and keys (the page table is the batch's)."""

    def __init__(self, rows: Sequence[Any], q_starts: Sequence[int],
                 device: torch.device) -> None:
        prompt = [row for row in rows if len(row.tokens) > 1]
        total = sum(len(row.tokens) for row in rows)
        self.cu_q = torch.as_tensor([*q_starts, total], dtype=torch.int32).to(device)
        self.seqused = torch.as_tensor([row.end if len(row.tokens) > 1 else 0 for row in rows],
                                       dtype=torch.int32).to(device)
        self.max_q = max((len(row.tokens) for row in prompt), default=1)
        self.max_k = max((row.end for row in prompt), default=1)
        self.any = bool(prompt)


def attend(query: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
           table: torch.Tensor, cu_q: torch.Tensor, seqused: torch.Tensor, max_q: int,
           max_k: int, scaling: float, out: torch.Tensor) -> torch.Tensor:
    """Causal attention of ``query`` ``[T, heads, dim]`` (segments ``cu_q``; row ``i``'s
    queries are the last of its ``seqused[i]`` keys) over pages ``[pages, page_size,
    kv_heads, dim]`` through ``table`` ``[rows, pages]`` int32, into ``out``. ``max_q`` and
    ``max_k`` bound the rows' queries and keys (a captured launch passes its capacity)."""
    fa3 = kernel()
    if fa3 is None:
        raise RuntimeError(f"FlashAttention 3 is not available: {missing()}")
    fa3(query, key_pages, value_pages, max_q, cu_q, max_k, seqused_k=seqused,
        block_table=table, causal=True, softmax_scale=scaling, num_splits=1, out=out)
    return out
