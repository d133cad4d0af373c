"""Fused projections for every forward on CUDA: q/k/v as one GEMM, the MLP's gate and up as one.

Owns ``FusedProjection`` (several ``nn.Linear`` over one input whose weights become row slices
of one concatenated weight), ``install``, which fuses every attention's q/k/v and every gated
MLP's gate/up of a Llama, Qwen2 or Mistral-style transformers model for good, ``projections``
(all of a group's outputs from one GEMM: ``fused.install_mlps``'s MLP forward takes gate and up
from it) and ``fused_groups`` (what is fused). A decode step of an 8B model ran 761 kernels
against vLLM's ~300; among them a GEMM each for q, k and v and for gate and up, every one with
its own cuBLAS split-K reduction. One GEMM over ``[nq + nk + nv, hidden]`` (and ``[2 * inter,
hidden]``) reads the input once and launches once.

How: the concatenated weight (and bias, where the model has one: Qwen2's q/k/v) is built once
and every module's ``weight``/``bias`` becomes a view into it, so nothing is held twice. The
first module's forward (``q_proj``, ``gate_proj``) runs the one GEMM, returns its slice and
keeps (input, result); a later module called with that same tensor object (transformers passes
one ``hidden_states`` to all three) returns its slice of the kept result, and the last one
(``v_proj``, ``up_proj``) drops both references. Called with any other tensor, a module runs its
own GEMM over its own view, so a lone call still computes its own projection. The slices are
last-dimension views of a contiguous result, so transformers' ``.view(..., heads,
head_dim).transpose(1, 2)`` works on them (the token stride is the fused width; kvtier's
kernels and the caches take any token stride). No copy, no host sync, and the same allocations
on every run: a CUDA-graph capture records one GEMM where it recorded three. The kept input
must not change in place between the first and the last module's calls (transformers'
attention and MLP never do that).

The GEMM is ``torch.nn.functional.linear`` (cuBLAS), or the function ``invariant.install``
passes in the deterministic mode (``invariant.linear``), which then also serves a lone module's
own GEMM. Every forward of the model, prefill, decode and hit, eager or captured, runs the same
fused GEMM, so a hit and a recompute round alike; the fused GEMM may round differently from
three separate ones (cuBLAS picks a kernel by shape; the invariant GEMM's segments follow the
weight's N), hence ``invariant.KERNELS`` moved with it.

``hf.load_model`` installs it on CUDA beside the other fused kernels, and ``invariant.install``
installs it again with its GEMM (on CUDA, or in the Triton interpreter for tests). Install once
the model has its device and dtype: ``Module.to`` would give each module a copy of its own.
Engine thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

#: ``linear(x, weight, bias)``: ``F.linear`` or ``invariant.linear``.
LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
#: The groups that fuse: a parent module holding all of these ``nn.Linear`` children gets one
#: GEMM for them; the first runs it, in transformers' call order.
GROUPS: dict[str, tuple[str, ...]] = {"qkv": ("q_proj", "k_proj", "v_proj"),
                                      "gate_up": ("gate_proj", "up_proj")}
#: Attribute of every member module naming its ``FusedProjection``.
_MARK = "_kvtier_fused_projection"


class FusedProjection:
    """``modules`` (``nn.Linear`` over the same inputs) computed by one GEMM over their
    concatenated weights; each module's weight and bias become views of the concatenation."""

    def __init__(self, modules: Sequence[torch.nn.Linear], linear: LinearFn) -> None:
        self.modules = tuple(modules)
        self.linear = linear
        with torch.no_grad():
            self.weight = torch.cat([m.weight for m in self.modules])
            self.bias = (torch.cat([m.bias for m in self.modules])
                         if self.modules[0].bias is not None else None)
        ends = [0]
        for module in self.modules:
            ends.append(ends[-1] + module.out_features)
        #: Each module's output columns in the fused result, ``(start, end)``.
        self.bounds = tuple(zip(ends[:-1], ends[1:], strict=True))
        for module, (start, end) in zip(self.modules, self.bounds, strict=True):
            module.weight = torch.nn.Parameter(self.weight[start:end], requires_grad=False)
            if self.bias is not None:
                module.bias = torch.nn.Parameter(self.bias[start:end], requires_grad=False)
            setattr(module, _MARK, self)
        self._input: torch.Tensor | None = None    # the first module's input, until the last's
        self._output: torch.Tensor | None = None   # the fused GEMM's result for it
        self.put_forwards()

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every module's output for ``x`` from one GEMM (views of its result), in order."""
        out = self.linear(x, self.weight, self.bias)
        return tuple(out[..., start:end] for start, end in self.bounds)

    @property
    def pending(self) -> bool:
        """Whether a fused result is kept for modules not yet called."""
        return self._input is not None

    def put_forwards(self) -> None:
        """Make the modules' forwards this group's (again, after another install replaced
        every ``nn.Linear``'s forward)."""
        for index, module in enumerate(self.modules):
            module.forward = self._lead() if index == 0 else self._follower(index)

    def _lead(self) -> Callable[[torch.Tensor], torch.Tensor]:
        start, end = self.bounds[0]

        def forward(x: torch.Tensor) -> torch.Tensor:
            out = self.linear(x, self.weight, self.bias)
            self._input, self._output = x, out
            return out[..., start:end]
        return forward

    def _follower(self, index: int) -> Callable[[torch.Tensor], torch.Tensor]:
        module = self.modules[index]
        start, end = self.bounds[index]
        last = index == len(self.modules) - 1

        def forward(x: torch.Tensor) -> torch.Tensor:
            out = self._output
            if out is None or x is not self._input:   # a lone call: its own GEMM
                return self.linear(x, module.weight, module.bias)
            if last:
                self._input = self._output = None
            return out[..., start:end]
        return forward


def _fusable(modules: Sequence[Any]) -> bool:
    if not all(isinstance(m, torch.nn.Linear) for m in modules):
        return False
    first = modules[0].weight
    return (len({m.in_features for m in modules}) == 1
            and len({(m.bias is None) for m in modules}) == 1
            and all(m.weight.dtype == first.dtype and m.weight.device == first.device
                    for m in modules)
            and first.device.type != "meta")


def _members(parent: torch.nn.Module, names: tuple[str, ...]) -> list[Any]:
    return [getattr(parent, name, None) for name in names]


def install(model: torch.nn.Module, linear: LinearFn | None = None) -> dict[str, int]:
    """From now on every module of ``model`` holding all of a group's projections (``GROUPS``)
    computes them with one GEMM; returns how many of each group. ``linear`` is the GEMM
    (default ``F.linear``). Installing again keeps the fused weights, sets ``linear`` where
    given (else keeps each group's) and puts the groups' forwards back."""
    counts = dict.fromkeys(GROUPS, 0)
    for parent in list(model.modules()):
        for group_name, names in GROUPS.items():
            modules = _members(parent, names)
            group = getattr(modules[0], _MARK, None)
            if isinstance(group, FusedProjection) and group.modules == tuple(modules):
                if linear is not None:
                    group.linear = linear
                group.put_forwards()
            elif _fusable(modules):
                FusedProjection(modules, linear or F.linear)
            else:
                continue
            counts[group_name] += 1
    return counts


def projections(modules: Sequence[torch.nn.Module], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each of ``modules``' output for ``x``, in order: one GEMM where they are one fused group,
    else each module's own forward."""
    group = getattr(modules[0], _MARK, None)
    if isinstance(group, FusedProjection) and group.modules == tuple(modules):
        return group.project(x)
    return tuple(module(x) for module in modules)


def fused_groups(model: torch.nn.Module) -> list[FusedProjection]:
    """``model``'s fused groups, in module order."""
    seen: dict[int, FusedProjection] = {}
    for module in model.modules():
        group = getattr(module, _MARK, None)
        if isinstance(group, FusedProjection):
            seen.setdefault(id(group), group)
    return list(seen.values())
