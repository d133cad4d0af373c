"""The deterministic mode (``engine.deterministic``): batch-invariant kernels for every forward.

Owns ``linear`` (``invariant_gemm.matmul``: one tile shape for every row count and one order
of sums over the inner dimension), ``attention_forward`` (the split-KV kernels in slices of
``SPLIT_TOKENS`` keys counted from position 0, merged in order) and ``install``, which puts
them, the fused RMSNorm and the fused projections (``fused_proj``: q/k/v and gate/up as one
``linear`` each) into a transformers model for good (the rotary embedding is element-wise
already, and the graphs' fused one is bit-identical to it).

Why: a cache hit computes a prompt's last tokens in a forward of a few rows over a stored past;
a recompute computes them inside one forward of every row. Library kernels pick their tiling
and their split of a sum by the number of rows (cuBLAS's split-K, sdpa's query blocks), so the
same row comes out with other roundings. Here every kernel computes a row, and a query, with
the same tiles and the same order of sums whatever else the forward holds: the embedding,
element-wise ops and these kernels are all there is, so logits after a hit are bit-identical to
a recompute's at any hit length, tier and page size, and a sequence's results do not depend on
what runs beside it. The stored past is bytes the same kernels produced, so it continues alike.

Cost: these kernels are slower than cuBLAS and flash attention (the matmul measured by
``benchmarks/engine/invariant_gemm.py``, the engine by ``benchmarks/engine/parity.py``'s notes
and README). CUDA, or the Triton interpreter on the CPU
(``TRITON_INTERPRET=1``, for tests); anything else is refused at start. Engine thread.
"""

from __future__ import annotations

import torch
import triton

from kvtier.engine import attention, fused, fused_proj, invariant_gemm
from kvtier.engine.rounding import INTERPRET
from kvtier.errors import ConfigError

NAME = "kvtier_deterministic"
#: Which sums these kernels do; part of the KV namespace of an engine running them (a page they
#: computed continues bit-identically only under the same sums). Change it with any kernel
#: change that moves a rounding.
#: 3: the MLP's SiLU and multiply as one kernel (fused.silu_mul). 4: q/k/v and gate/up as one
#: GEMM each (fused_proj): the matmul's segments over K follow the weight's shape (N, K), so the
#: fused weight sums some elements in other segments than the separate ones did.
KERNELS = "invariant-4"
#: Keys per attention slice: a multiple of the kernels' 64-key block and of every page size
#: up to 256, so that slices of a hit's past and of a recompute are the same slices.
SPLIT_TOKENS = 256
#: Bound on the per-slice partial results of one prefill launch; longer prompts run their
#: queries in several launches (a query's result does not depend on the launch).
PARTIAL_BYTES = 256 << 20


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``torch.nn.functional.linear`` with a row's result independent of the other rows."""
    inner = x.shape[-1]
    if weight.shape[1] != inner:
        raise ValueError(f"linear: input width {inner} does not match weight {tuple(weight.shape)}")
    rows = x.reshape(-1, inner)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = invariant_gemm.matmul(rows, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def attention_forward(module: object, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      **kwargs: object) -> tuple[torch.Tensor, None]:
    """transformers attention function: causal attention in fixed slices (one unpadded
    sequence, the new tokens last, as the engine runs it)."""
    if dropout or kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise ValueError("the deterministic attention takes no dropout, softcap or sliding window")
    past = attention.device_past_now()
    if past is not None:
        return attention.split_kv_attention(query, key, value, scaling, past=past,
                                            split_tokens=SPLIT_TOKENS), None
    n_queries, n_keys = query.shape[2], key.shape[2]
    per_query = query.shape[1] * triton.cdiv(n_keys, SPLIT_TOKENS) * query.shape[3] * 4
    step = max(1, PARTIAL_BYTES // per_query)
    outs = []
    for first in range(0, n_queries, step):
        last = min(first + step, n_queries)
        visible = n_keys - n_queries + last   # bottom-right aligned: the chunk's keys end here
        outs.append(attention.split_kv_attention(
            query[:, :, first:last], key[:, :, :visible], value[:, :, :visible], scaling,
            split_tokens=SPLIT_TOKENS))
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), None


def check_device(device: torch.device) -> None:
    """Refuse, naming the setting, a device the kernels cannot run on."""
    if device.type != "cuda" and not INTERPRET:
        raise ConfigError("engine.deterministic", "true",
                          "CUDA, or the Triton interpreter on the CPU (TRITON_INTERPRET=1)")


def install(model: torch.nn.Module, device: torch.device) -> dict[str, int]:
    """Put the batch-invariant kernels into ``model`` for good; returns what was replaced
    (``linear`` modules, ``norm`` modules, fused ``qkv`` and ``gate_up`` groups). The fused
    projections run ``linear`` too, also where ``hf.load_model`` fused them before this."""
    check_device(device)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for module in linears:
        module.forward = _linear_forward(module)
    groups = fused_proj.install(model, linear)   # after: it puts the groups' forwards back
    norms = fused.install_norms(model)
    if not attention.install(model, NAME, attention_forward):
        raise ConfigError("engine.deterministic", "true",
                          "a transformers version with an attention registry")
    return {"linear": len(linears), "norm": norms, **groups}


def _linear_forward(module: torch.nn.Linear) -> object:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return linear(x, module.weight, module.bias)
    return forward
