"""Fused element-wise kernels for every forward on CUDA: RMSNorm, the rotary embedding, SiLU·mul.

Owns ``rms_norm``, ``rotary`` and ``silu_mul`` (Triton kernels); ``install_norms``,
``install_rotary`` and ``install_mlps``, which put them into a Llama, Qwen2 or Mistral-style
transformers model for good (``hf.load_model`` on CUDA: prefill, decode and hit forwards then
run the same kernels); and ``fused_modules``, a context manager that swaps the norms and the
rotary embedding in for a scope. transformers' RMSNorm is eight small kernels (cast, square,
mean, add, rsqrt, multiply, cast, scale), its rotary embedding five per tensor (two multiplies, a
negation, a concatenation, an add) and its MLP's activation two (SiLU, then the multiply by
``up``): about 900 of an 8B model's 1600 kernels per forward, and in a 4k-token prefill on an
H100 15 of its 120 ms of GPU time went to such element-wise kernels
(``benchmarks/engine/prefill_profile.py``). Here each is one kernel.

Rounding follows transformers step by step (``docs/architecture.md``, "Numerics"):

- ``rotary`` is element-wise and rounds where transformers does: ``x * cos`` and
  ``rotate_half(x) * sin`` each to the result dtype, then their sum (cos/sin stay in the dtype
  ``rotary_emb`` gave them, x's). No fused multiply-add. Its output is bit-identical to
  ``apply_rotary_pos_emb`` in fp32, bf16 and fp16.
- ``silu_mul`` computes ``gate / (1 + exp(-gate))`` in fp32 as torch's CUDA SiLU does (the
  correctly rounded division, CUDA's ``expf``), rounds it to the dtype, multiplies by ``up``
  in fp32 and rounds again, as ``act_fn(gate_proj(x)) * up_proj(x)`` does. (In the Triton
  interpreter ``exp`` is numpy's, which may differ from the CPU's torch in the last bit.)
- ``rms_norm`` squares in fp32, means, adds eps, takes rsqrt and scales in fp32, rounds to x's
  dtype, then multiplies by the weight and rounds again, as ``LlamaRMSNorm`` does. What it
  cannot copy is the order of the mean's sum and the rsqrt's last bit (torch's reduction and
  rsqrt differ per backend); so where the graphs use it, every forward of the model does
  (``install_norms``, also the no-cache prefill), and both paths compute alike. One program
  reduces one row in a fixed order: a row's result never depends on the other rows.

``SuffixGraphs`` enters ``fused_modules`` while it warms up and captures its steps (and while it
runs them eagerly without CUDA); ``hf.load_model`` installs all three with the kvtier attention
on CUDA, beside ``fused_proj`` (q/k/v and gate/up as one GEMM each). Engine thread.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kvtier.engine import fused_proj
from kvtier.engine.rounding import INTERPRET, round_to

#: Elements a program of ``silu_mul``.
SILU_BLOCK = 1024
#: Marks a module-level ``apply_rotary_pos_emb`` that is already ours (never wrapped twice).
_FUSED_MARK = "_kvtier_fused_rotary"


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, n_cols, eps,
                     BLOCK: tl.constexpr):
    """One row: x * rsqrt(mean(x^2) + eps) in fp32, rounded to x's dtype, times the weight."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, 0) / n_cols
    normed = round_to(x * tl.rsqrt(variance + eps), x_ptr.dtype.element_ty)
    weight = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = round_to(weight.to(tl.float32) * normed, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm of ``x`` (``[..., hidden]``) as one kernel; the result has the
    dtype transformers gives (``weight``'s and ``x``'s promoted)."""
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.result_type(weight, x), device=x.device)
    _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), hidden,
                                       eps, BLOCK=triton.next_power_of_2(hidden),
                                       enable_fp_fusion=False)
    return out.view(x.shape)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, sx_h, sx_t, sc_t, so_h, so_t,
                   HALF: tl.constexpr, HEADS: tl.constexpr):
    """One token, every head: ``x * cos + rotate_half(x) * sin``, each product and the sum
    rounded to the output dtype, as transformers' element-wise ops round them."""
    token = tl.program_id(0)
    cols = tl.arange(0, 2 * HALF)
    rows = tl.arange(0, HEADS)
    ok = (rows < heads)[:, None]
    partner = (cols + HALF) % (2 * HALF)
    base = x_ptr + token * sx_t + rows[:, None] * sx_h
    x = tl.load(base + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    other = tl.load(base + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    rotated = tl.where((cols < HALF)[None, :], -other, other)
    cos = tl.load(cos_ptr + token * sc_t + cols).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + token * sc_t + cols).to(tl.float32)[None, :]
    out_ty = out_ptr.dtype.element_ty
    first = round_to(x * cos, out_ty)
    second = round_to(rotated * sin, out_ty)
    out = round_to(first + second, out_ty)
    tl.store(out_ptr + token * so_t + rows[:, None] * so_h + cols[None, :], out.to(out_ty),
             mask=ok)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    _, heads, tokens, dim = x.shape
    # laid out as transformers' projections leave it: [1, tokens, heads, dim] seen as heads-first
    out = torch.empty((1, tokens, heads, dim), dtype=torch.result_type(x, cos),
                      device=x.device).transpose(1, 2)
    _rotary_kernel[(tokens,)](x, cos, sin, out, heads, x.stride(1), x.stride(2), cos.stride(1),
                              out.stride(1), out.stride(2), HALF=dim // 2,
                              HEADS=triton.next_power_of_2(heads), enable_fp_fusion=False)
    return out


def rotary_fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                unsqueeze_dim: int = 1) -> bool:
    """Whether ``rotary`` takes these: one sequence, ``q``/``k`` ``[1, heads, tokens, dim]``
    and ``cos``/``sin`` ``[1, tokens, dim]``, all with a contiguous last dim (dim a power of 2)."""
    dim = q.shape[-1]
    return (unsqueeze_dim == 1 and q.dim() == 4 and k.dim() == 4 and q.shape[0] == 1
            and k.shape[0] == 1 and cos.dim() == 3 and cos.shape[0] == 1
            and cos.stride() == sin.stride() and dim >= 2 and dim & (dim - 1) == 0
            and k.shape[-1] == dim and cos.shape[-1] == dim
            and all(t.stride(-1) == 1 for t in (q, k, cos, sin)))


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` (for what ``rotary_fits``), one kernel per
    tensor."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _fused_rotary(original: Any) -> Any:
    """``apply_rotary_pos_emb`` through ``rotary`` where it fits, ``original`` elsewhere
    (``__wrapped__``)."""
    @functools.wraps(original)
    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor, unsqueeze_dim: int = 1) -> Any:
        if rotary_fits(q, k, cos, sin, unsqueeze_dim):
            return rotary(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)
    setattr(apply_rotary_pos_emb, _FUSED_MARK, True)
    return apply_rotary_pos_emb


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n_cols, s_gate, s_up, s_out,
                     BLOCK: tl.constexpr, INTERPRET_MODE: tl.constexpr):
    """``BLOCK`` columns of one row: ``silu(gate)`` rounded to the dtype, times ``up``, rounded."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    gate = tl.load(gate_ptr + row * s_gate + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * s_up + cols, mask=ok, other=0.0).to(tl.float32)
    if INTERPRET_MODE:   # noqa: SIM108 (a constexpr branch: one of the two is compiled)
        exp = tl.exp(-gate)
    else:
        exp = libdevice.exp(-gate)   # CUDA's expf, as torch's SiLU kernel calls it
    out_ty = out_ptr.dtype.element_ty
    act = round_to(tl.math.div_rn(gate, 1.0 + exp), out_ty)
    tl.store(out_ptr + row * s_out + cols, round_to(act * up, out_ty).to(out_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as 2-D rows of its last dimension, copied only where no such view exists."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for same-shape ``[..., width]`` tensors, as one kernel, rounded as
    torch rounds the two ops. Rows may have any stride (the two halves of the fused gate/up
    GEMM's result are read in place); only a last dimension that is not contiguous is copied."""
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    g, u = _rows(gate), _rows(up)
    out = torch.empty(g.shape, dtype=torch.result_type(gate, up), device=gate.device)
    if out.numel():
        width = g.shape[1]
        block = min(SILU_BLOCK, triton.next_power_of_2(width))
        _silu_mul_kernel[(g.shape[0], triton.cdiv(width, block))](
            g, u, out, width, g.stride(0), u.stride(0), out.stride(0), BLOCK=block,
            INTERPRET_MODE=INTERPRET, enable_fp_fusion=False)
    return out.view(gate.shape)


def _is_silu_mlp(module: Any) -> bool:
    act = getattr(module, "act_fn", None)
    return (type(module).__name__.endswith("MLP")
            and all(isinstance(getattr(module, name, None), torch.nn.Linear)
                    for name in ("gate_proj", "up_proj", "down_proj"))
            and (isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"))


def install_mlps(model: Any) -> int:
    """From now on every gated SiLU MLP of ``model`` (``down(silu(gate(x)) * up(x))``, as Llama,
    Qwen2 and Mistral have) runs ``silu_mul`` between its projections; returns how many. Gate
    and up come from one GEMM where ``fused_proj.install`` fused them (before or after this)."""
    mlps = [m for m in model.modules() if _is_silu_mlp(m)]
    for mlp in mlps:
        mlp.forward = _mlp_forward(mlp)
    return len(mlps)


def _mlp_forward(module: Any) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        # one GEMM for both where they are fused (fused_proj): gate and up are then the two
        # halves of its result, rows with the fused width as their stride
        gate, up = fused_proj.projections((module.gate_proj, module.up_proj), x)
        return module.down_proj(silu_mul(gate, up))
    return forward


def _rotary_homes(model: Any) -> set[Any]:
    """The modules whose ``apply_rotary_pos_emb`` ``model``'s attention layers call."""
    return {sys.modules[type(m).__module__] for m in model.modules()
            if hasattr(sys.modules[type(m).__module__], "apply_rotary_pos_emb")
            and type(m).__name__.endswith("Attention")}


def install_rotary(model: Any) -> int:
    """From now on ``model``'s attention layers apply the rotary embedding with ``rotary`` where
    it fits (returns how many modules' functions were replaced). The function is replaced in
    its transformers module, so every model of that kind in the process gets it: the results
    are bit-identical to transformers' own, and shapes the kernel does not take go to it."""
    homes = [home for home in _rotary_homes(model)
             if not getattr(home.apply_rotary_pos_emb, _FUSED_MARK, False)]
    for home in homes:
        home.apply_rotary_pos_emb = _fused_rotary(home.apply_rotary_pos_emb)
    return len(homes)


def _is_rms_norm(module: Any) -> bool:
    return (type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")
            and isinstance(getattr(module, "weight", None), torch.Tensor))


def install_norms(model: Any) -> int:
    """From now on every RMSNorm module of ``model`` runs ``rms_norm`` (returns how many): all
    its forwards, prefill, decode and hit, then reduce each row alike."""
    norms = [m for m in model.modules() if _is_rms_norm(m)]
    for norm in norms:
        norm.forward = _norm_forward(norm)
    return len(norms)


@contextlib.contextmanager
def fused_modules(model: Any) -> Iterator[int]:
    """Within: ``model``'s RMSNorm modules and its attention's ``apply_rotary_pos_emb`` run the
    fused kernels. Yields how many modules and functions were replaced (norms and functions
    that ``install_norms`` and ``install_rotary`` replaced already are left as they are, and
    stay)."""
    norms = [m for m in model.modules() if _is_rms_norm(m) and "forward" not in m.__dict__]
    saved = [(home, home.apply_rotary_pos_emb) for home in _rotary_homes(model)
             if not getattr(home.apply_rotary_pos_emb, _FUSED_MARK, False)]
    for norm in norms:
        norm.forward = _norm_forward(norm)
    for home, original in saved:
        home.apply_rotary_pos_emb = _fused_rotary(original)
    try:
        yield len(norms) + len(saved)
    finally:
        for norm in norms:
            norm.__dict__.pop("forward", None)
        for home, original in saved:
            home.apply_rotary_pos_emb = original


def _norm_forward(module: Any) -> Any:
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, module.weight, module.variance_epsilon)
    return forward
