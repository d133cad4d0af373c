"""Fused RMSNorm and rotary-embedding kernels for the suffix forward and the prefill.

Owns ``rms_norm`` and ``rotary`` (Triton kernels), ``install_norms`` (a model's RMSNorm modules
run ``rms_norm`` for good) and ``fused_modules``, a context manager under which a Llama, Qwen2
or Mistral-style transformers model also runs ``rotary``. A captured forward of a few tokens is
bound by its kernels, not their launches: transformers' RMSNorm is eight small kernels (cast,
square, mean, add, rsqrt, multiply, cast, scale) and its rotary embedding five per tensor (two
multiplies, a negation, a concatenation, an add), about 900 of an 8B model's 1600 kernels per
forward for a fifth of its GPU time. Here each is one kernel.

Rounding follows transformers step by step (``docs/architecture.md``, "Numerics"):

- ``rotary`` is element-wise and rounds where transformers does: ``x * cos`` and
  ``rotate_half(x) * sin`` each to the result dtype, then their sum (cos/sin stay in the dtype
  ``rotary_emb`` gave them, x's). No fused multiply-add. Its output is bit-identical to
  ``apply_rotary_pos_emb`` in fp32, bf16 and fp16.
- ``rms_norm`` squares in fp32, means, adds eps, takes rsqrt and scales in fp32, rounds to x's
  dtype, then multiplies by the weight and rounds again, as ``LlamaRMSNorm`` does. What it
  cannot copy is the order of the mean's sum and the rsqrt's last bit (torch's reduction and
  rsqrt differ per backend); so where the graphs use it, every forward of the model does
  (``install_norms``, also the no-cache prefill), and both paths compute alike. One program
  reduces one row in a fixed order: a row's result never depends on the other rows.

``SuffixGraphs`` enters ``fused_modules`` while it warms up and captures its steps (and while it
runs them eagerly without CUDA); ``hf.load_model`` installs the norms with the kvtier attention
on CUDA. Engine thread.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import triton
import triton.language as tl

from kvtier.engine.rounding import round_to


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
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, sx_h, sx_t, sc_t, so_h, so_t,
                   HALF: tl.constexpr):
    """One (token, head) row: ``x * cos + rotate_half(x) * sin``, each product and the sum
    rounded to the output dtype, as transformers' element-wise ops round them."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.arange(0, 2 * HALF)
    partner = (cols + HALF) % (2 * HALF)
    base = x_ptr + head * sx_h + token * sx_t
    x = tl.load(base + cols).to(tl.float32)
    other = tl.load(base + partner).to(tl.float32)
    rotated = tl.where(cols < HALF, -other, other)
    cos = tl.load(cos_ptr + token * sc_t + cols).to(tl.float32)
    sin = tl.load(sin_ptr + token * sc_t + cols).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    first = round_to(x * cos, out_ty)
    second = round_to(rotated * sin, out_ty)
    out = round_to(first + second, out_ty)
    tl.store(out_ptr + head * so_h + token * so_t + cols, out.to(out_ty))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    _, heads, tokens, dim = x.shape
    # laid out as transformers' projections leave it: [1, tokens, heads, dim] seen as heads-first
    out = torch.empty((1, tokens, heads, dim), dtype=torch.result_type(x, cos),
                      device=x.device).transpose(1, 2)
    _rotary_kernel[(tokens, heads)](x, cos, sin, out, x.stride(1), x.stride(2), cos.stride(1),
                                    out.stride(1), out.stride(2), HALF=dim // 2,
                                    enable_fp_fusion=False)
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
    """``apply_rotary_pos_emb`` through ``rotary`` where it fits, ``original`` elsewhere."""
    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor, unsqueeze_dim: int = 1) -> Any:
        if rotary_fits(q, k, cos, sin, unsqueeze_dim):
            return rotary(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)
    return apply_rotary_pos_emb


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
    fused kernels. Yields how many modules and functions were replaced (norms that
    ``install_norms`` replaced already are left as they are, and stay)."""
    norms = [m for m in model.modules() if _is_rms_norm(m) and "forward" not in m.__dict__]
    rotary_homes = {sys.modules[type(m).__module__] for m in model.modules()
                    if hasattr(sys.modules[type(m).__module__], "apply_rotary_pos_emb")
                    and type(m).__name__.endswith("Attention")}
    saved = [(home, home.apply_rotary_pos_emb) for home in rotary_homes]
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
