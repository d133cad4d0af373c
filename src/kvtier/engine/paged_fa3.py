"""FlashAttention 3 over the device pool's pages: the prefill attention on Hopper where it is installed.

Owns ``choose`` (which kernels read the pool in a forward: ``engine.prefill_attention``
resolved against the GPU, the dtype, the model and what is importable), ``launch`` (one FA3
launch over the device pool's pages, ``[pages, page_size, kv_heads, head_dim]``, read in place
as FA3's paged key/value cache) and ``attend`` (a step's prompt rows as its plan,
``paged_fa3_plan``, lays them out: a causal launch, the full key segments' launches, the merge).

Why: at 32k tokens the prefill is attention-bound. FA3, which vLLM runs on Hopper, computes a
32k causal layer of an 8B model over kvtier's pool in 13.3 ms on an H100 where kvtier's Triton
flash kernel takes 19.8 ms (``benchmarks/results/fa3_probe_h100.txt``): warp-specialized
producer and consumer warps that Triton 3.6 does not give. FA3 comes from vLLM's wheel
(``vllm.vllm_flash_attn``, FA3 built in); without it, on other GPUs, in fp32, at head
dimensions other than 128 or in the deterministic mode the Triton kernels serve
(``paged_triton``, ``paged_prefill_split``).

The numerics contract (a hit's tokens are a recompute's) holds when every prefill-shaped
attention of the engine runs here: the batched steps' prompt rows (``paged.PagedBatch``) and
the captured steps of a hit's suffix (``suffix_step``). Every launch is unsplit
(``num_splits=1``): each query row then sums an entry's keys in fixed blocks counted from the
entry's first key, whatever tile the row sits in, whatever else the launch holds. That was
measured, not assumed, on an H100 (``tests/test_paged_fa3_gpu.py``: the same bits whole, in
steps, as a suffix, beside other rows and from a graph, at head_dim 128, pages of 1 to 256
tokens, GQA 4 and 7, bf16 and fp16); at head_dim 64 it did not hold (``HEAD_DIMS``). The
entries themselves are cut at fixed key positions (``paged_fa3_plan``), so what a row computes
depends on its position only, and a hit's short suffix over a long past still runs on many
programs. A decode row (a generated token) gets an empty entry here (FA3 writes zeros,
reading nothing) and its attention from the split-KV decode kernel after. Engine thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
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

#: A one-pass step (a hit's suffix, a short chunk) runs its two launches on two streams: each
#: holds a few programs per KV head, so side by side they take the time of the longer.
OVERLAP = True
_SIDE: dict[int, Any] = {}
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


class _Row:
    """A prompt row for the trial launch: ``paged.BatchRow``'s fields the plan reads (``paged``
    imports this module, so it cannot be imported here)."""

    def __init__(self, pages: list[int], start: int, count: int) -> None:
        self.pages, self.start, self.tokens = pages, start, [0] * count
        self.decode = False

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


def _refused(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why one small launch of this shape fails here (a build without this head_dim or
    GPU), or None: found at load rather than in a request's step."""
    try:
        from kvtier.engine import paged_fa3_plan

        page = 16
        segment = paged_fa3_plan.segment_for(page)
        pages = torch.zeros((segment // page + 2, page, 1, head_dim), dtype=dtype, device=device)
        row = _Row(list(range(pages.shape[0])), segment - 2, 4)   # crosses the first cut
        query = torch.zeros((4, 2, head_dim), dtype=dtype, device=device)
        plan = paged_fa3_plan.plan_step([row], [0], page, device)
        attend(query, pages, pages, plan, head_dim ** -0.5, torch.empty_like(query))
        torch.cuda.synchronize(device)
    except Exception as exc:   # any failure of the trial launch: the Triton kernels serve
        return f"a trial FA3 launch failed: {type(exc).__name__}: {exc}".splitlines()[0]
    return None


def launch(query: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
           entries: Any, max_k: int, causal: bool, scaling: float,
           out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One FA3 launch of ``entries`` (``paged_fa3_plan.Launch``) over pages ``[pages,
    page_size, kv_heads, dim]``: ``query`` ``[T, heads, dim]``; causal aligns an entry's
    queries with its last keys. Returns (output ``[T, heads, dim]``, log-sum-exp ``[heads, T]``
    fp32); ``max_k`` bounds an entry's keys."""
    fa3 = kernel()
    if fa3 is None:
        raise RuntimeError(f"FlashAttention 3 is not available: {missing()}")
    got = fa3(query, key_pages, value_pages, entries.max_q, entries.cu_q, max_k,
              seqused_k=entries.seqused, block_table=entries.table, causal=causal,
              softmax_scale=scaling, num_splits=1, out=out, return_softmax_lse=True)
    return got[0], got[1]


def attend(query: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
           plan: Any, scaling: float, out: torch.Tensor) -> torch.Tensor:
    """A step's prompt rows (``plan``: ``paged_fa3_plan.Plan``) attend over the pages into
    ``out``: the causal launch over each row's own segment in place, then each pass's
    full segments over gathered queries, folded into ``out`` (``paged_fa3_merge``)."""
    from kvtier.engine import paged_fa3_merge

    if len(plan.passes) == 1 and query.is_cuda and OVERLAP:   # a suffix: both launches at once
        (full,) = plan.passes
        current = torch.cuda.current_stream(query.device)
        side = _side_stream(query.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            part, part_lse = launch(query.index_select(0, full.gather), key_pages, value_pages,
                                    full.launch, plan.segment, False, scaling)
        _, lse = launch(query, key_pages, value_pages, plan.own, plan.segment, True, scaling,
                        out)
        current.wait_stream(side)   # what the side stream allocated is reused there only
        paged_fa3_merge.merge(out, lse, part, part_lse, full.rows, full.parts, full.counts)
        return out
    _, lse = launch(query, key_pages, value_pages, plan.own, plan.segment, True, scaling, out)
    for full in plan.passes:
        part, part_lse = launch(query.index_select(0, full.gather), key_pages, value_pages,
                                full.launch, plan.segment, False, scaling)
        paged_fa3_merge.merge(out, lse, part, part_lse, full.rows, full.parts, full.counts)
    return out


def _side_stream(device: torch.device) -> Any:
    """The stream the full segments' launch of a one-pass step runs on, beside the causal
    one (one per device; every use starts by waiting on the current stream)."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE.get(key)
    if stream is None:
        stream = _SIDE[key] = torch.cuda.Stream(device)
    return stream
