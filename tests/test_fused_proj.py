"""Fused projections (``kvtier.engine.fused_proj``) on the tiny presets, CPU, fp32: installed, q/k/v
and gate/up run one GEMM each (7 GEMMs a layer become 4), the logits stay the unfused model's,
the modules' weights are views of the fused weight (no byte more), a lone module call computes
its own projection, and in the deterministic mode (Triton interpreter) the fused invariant GEMM
gives the unfused one's bits on shapes where both cut K into the same segments."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from kvtier.engine import fused, fused_proj, invariant, invariant_gemm
from kvtier.engine.hf import CausalLM, load_model
from test_deterministic import deterministic_lm

#: Cases that run kvtier's Triton kernels on CPU tensors: only the interpreter can (on a CUDA
#: machine the GPU tests cover those kernels).
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1")


class _LinearCalls(TorchFunctionMode):
    """Counts ``F.linear`` calls (what ``nn.Linear`` and the fused groups run off CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _fresh(name: str) -> CausalLM:
    """Its own copy of a preset (the shared ``tiny_lm`` must stay unfused), random biases."""
    lm = load_model(name, device="cpu", dtype="float32")
    with torch.no_grad():
        for param_name, param in lm.model.named_parameters():
            if param_name.endswith("bias"):
                param.normal_(0.0, 0.5)
    return lm


def _tokens(n: int) -> torch.Tensor:
    return torch.randint(5, 1000, (n,), generator=torch.Generator().manual_seed(n))


def _prefill_and_step(lm: CausalLM) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Every position's logits of a 40-token prefill, a decode step's, GEMMs of each."""
    cache = lm.new_cache()
    counts = []
    with _LinearCalls() as calls:
        prefill = lm.forward(_tokens(40), cache, all_logits=True)
    counts.append(calls.count)
    with _LinearCalls() as calls:
        step = lm.forward(torch.tensor([7]), cache)
    counts.append(calls.count)
    return prefill, step, counts


def _bytes(model: torch.nn.Module) -> int:
    """Bytes of every storage behind the parameters and the fused groups' weights and biases."""
    tensors = list(model.parameters())
    for group in fused_proj.fused_groups(model):
        tensors += [t for t in (group.weight, group.bias) if t is not None]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


@interpreted
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_fused_projections_give_the_unfused_logits_with_fewer_gemms(name):
    lm = _fresh(name)
    layers = lm.config.num_hidden_layers
    want_prefill, want_step, want_counts = _prefill_and_step(lm)
    assert want_counts == [7 * layers + 1] * 2   # q, k, v, o, gate, up, down; the head
    assert fused_proj.install(lm.model) == {"qkv": layers, "gate_up": layers}
    got_prefill, got_step, counts = _prefill_and_step(lm)
    assert counts == [4 * layers + 1] * 2        # qkv, o, gate_up, down; the head
    assert float((got_prefill - want_prefill).abs().max()) <= 1e-5
    assert float((got_step - want_step).abs().max()) <= 1e-5
    # nothing kept past a forward: the last module of every group dropped the fused result
    assert not any(group.pending for group in fused_proj.fused_groups(lm.model))
    # with the fused MLP forward as on CUDA: gate and up still one GEMM, the halves read in place
    halves = []
    real = fused.silu_mul
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused, "silu_mul", lambda g, u: halves.append((g, u)) or real(g, u))
        assert fused.install_mlps(lm.model) == layers
        mlp_prefill, _, counts = _prefill_and_step(lm)
    assert counts == [4 * layers + 1] * 2
    assert float((mlp_prefill - want_prefill).abs().max()) <= 1e-5
    gate, up = halves[0]
    inter = lm.config.intermediate_size
    assert gate.stride(-2) == up.stride(-2) == 2 * inter and gate.stride(-1) == 1
    assert up.data_ptr() == gate.data_ptr() + inter * gate.element_size()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_each_projection_is_its_own_linear_of_the_input(name):
    lm = _fresh(name)
    attn, mlp = lm.model.model.layers[1].self_attn, lm.model.model.layers[1].mlp
    members = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
    saved = [(m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone())
             for m in members]
    fused_proj.install(lm.model)
    x = torch.randn(1, 9, lm.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        outs = [module(x) for module in members]
    for out, (weight, bias) in zip(outs, saved, strict=True):
        want = F.linear(x, weight, bias)
        assert out.shape == want.shape
        assert float((out - want).abs().max()) <= 1e-5
    # transformers' view of a head-sliced projection works on the slices of the fused result
    heads, dim = lm.num_kv_heads, lm.head_dim
    keys = outs[1].view(1, 9, heads, dim).transpose(1, 2)
    assert keys.untyped_storage().data_ptr() == outs[0].untyped_storage().data_ptr()
    assert torch.equal(keys.transpose(1, 2).reshape(1, 9, -1), outs[1])


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_weights_and_biases_are_views_of_the_fused_ones(name):
    lm = _fresh(name)
    before = _bytes(lm.model)
    fused_proj.install(lm.model)
    assert _bytes(lm.model) == before          # no parameter byte held twice
    attn = lm.model.model.layers[0].self_attn
    group = fused_proj.fused_groups(attn)[0]
    assert group.modules == (attn.q_proj, attn.k_proj, attn.v_proj)
    row, size = group.weight.stride(0), group.weight.element_size()
    offset = 0
    for module in group.modules:
        assert module.weight.untyped_storage().data_ptr() == group.weight.untyped_storage().data_ptr()
        assert module.weight.data_ptr() == group.weight.data_ptr() + offset * row * size
        if group.bias is not None:
            assert module.bias.data_ptr() == group.bias.data_ptr() + offset * size
        offset += module.out_features
    assert (group.bias is not None) == (name == "tiny-qwen2")   # Qwen2's q/k/v biases
    with torch.no_grad():                      # one tensor: a write to it is the module's
        group.weight[attn.q_proj.out_features].fill_(2.5)
    assert bool((attn.k_proj.weight[0] == 2.5).all())


def test_a_lone_call_computes_its_own_projection():
    lm = _fresh("tiny-qwen2")
    fused_proj.install(lm.model)
    attn = lm.model.model.layers[2].self_attn
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 6, lm.config.hidden_size, generator=gen)
    y = torch.randn(1, 4, lm.config.hidden_size, generator=gen)
    with torch.no_grad():
        with _LinearCalls() as calls:
            q = attn.q_proj(x)                 # the fused GEMM, kept for k and v of x
            k_of_y = attn.k_proj(y)            # another tensor: k's own GEMM
            v = attn.v_proj(x)                 # x's: a slice of the kept result
        assert calls.count == 2
        assert float((k_of_y - F.linear(y, attn.k_proj.weight, attn.k_proj.bias)).abs().max()) <= 1e-5
        assert float((v - F.linear(x, attn.v_proj.weight, attn.v_proj.bias)).abs().max()) <= 1e-5
        assert q.shape[-1] == attn.q_proj.out_features
        assert not fused_proj.fused_groups(attn)[0].pending   # v came: the result is dropped
        with _LinearCalls() as calls:
            k_again = attn.k_proj(x)           # x's result is gone: its own GEMM again
            k_of_copy = attn.k_proj(x.clone())  # equal values, another tensor: its own GEMM
        assert calls.count == 2
        want = F.linear(x, attn.k_proj.weight, attn.k_proj.bias)
        assert float((k_again - want).abs().max()) <= 1e-5
        assert torch.equal(k_of_copy, k_again)


@interpreted
def test_installing_again_keeps_the_fused_weights_and_puts_the_forwards_back():
    lm = _fresh("tiny-llama")
    layers = lm.config.num_hidden_layers
    fused_proj.install(lm.model)
    groups = fused_proj.fused_groups(lm.model)
    weights = [group.weight for group in groups]
    assert len(groups) == 2 * layers and all(g.linear is F.linear for g in groups)
    for module in lm.model.modules():        # as invariant.install does to every nn.Linear
        if isinstance(module, torch.nn.Linear):
            module.forward = lambda x, m=module: invariant.linear(x, m.weight, m.bias)
    calls = []
    real = invariant.linear

    def counted(x, weight, bias):
        calls.append(tuple(weight.shape))
        return real(x, weight, bias)

    assert fused_proj.install(lm.model, counted) == {"qkv": layers, "gate_up": layers}
    assert fused_proj.fused_groups(lm.model) == groups
    assert [group.weight for group in groups] == weights   # the same tensors, not rebuilt
    attn = lm.model.model.layers[0].self_attn
    x = torch.randn(1, 3, lm.config.hidden_size)
    with torch.no_grad():
        for module in (attn.q_proj, attn.k_proj, attn.v_proj):
            module(x)
    assert calls == [tuple(groups[0].weight.shape)]
    # without a GEMM named, an install keeps each group's
    fused_proj.install(lm.model)
    assert all(group.linear is counted for group in groups)


def test_the_fused_weight_moves_the_invariant_segments():
    """Why ``invariant.KERNELS`` moved: at llama3-8b's shapes the fused weights cut K into other
    segments than the separate ones, so a fused element may sum in another order."""
    hidden, q, kv, inter = 4096, 4096, 1024, 14336
    fused_qkv = invariant_gemm.tiles_for(torch.bfloat16, q + 2 * kv, hidden)
    fused_gate_up = invariant_gemm.tiles_for(torch.bfloat16, 2 * inter, hidden)
    assert fused_qkv.segments != invariant_gemm.tiles_for(torch.bfloat16, q, hidden).segments
    assert fused_qkv.segments != invariant_gemm.tiles_for(torch.bfloat16, kv, hidden).segments
    assert fused_gate_up.segments != invariant_gemm.tiles_for(torch.bfloat16, inter, hidden).segments
    assert invariant.KERNELS == "invariant-4"


@interpreted
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_deterministic_mode_fuses_through_the_invariant_gemm(dtype, monkeypatch):
    """``invariant.install`` fuses with its own GEMM; at these shapes every weight, fused or
    not, has one segment over K, so the fused model's logits are the unfused one's bits."""
    lm = deterministic_lm("qwen2", dtype)
    layers = lm.config.num_hidden_layers
    groups = fused_proj.fused_groups(lm.model)
    assert len(groups) == 2 * layers and all(g.linear is invariant.linear for g in groups)
    with monkeypatch.context() as patch:    # the same model and weights, left unfused
        patch.setattr(fused_proj, "install", lambda model, linear=None: {})
        plain = deterministic_lm("qwen2", dtype)
    assert not fused_proj.fused_groups(plain.model)
    shapes = []
    real = invariant_gemm.matmul
    monkeypatch.setattr(invariant_gemm, "matmul",
                        lambda x, w, b, **kw: shapes.append(tuple(w.shape)) or real(x, w, b, **kw))
    tokens = _tokens(20)
    want = plain.forward(tokens, plain.new_cache(), all_logits=True)
    assert len(shapes) == 7 * layers + 1
    shapes.clear()
    got = lm.forward(tokens, lm.new_cache(), all_logits=True)
    assert len(shapes) == 4 * layers + 1
    assert tuple(groups[0].weight.shape) in shapes and tuple(groups[1].weight.shape) in shapes
    assert torch.equal(got, want)
