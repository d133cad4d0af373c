"""The deterministic mode (``engine.deterministic``) in the Triton interpreter (CPU): the
batch-invariant matmul gives a row the same bits whatever rows share its forward, and through
the tiered cache a device or host hit of any length gives last-position logits bit-identical to
a recompute, on Llama (GQA 2:1, head_dim 64), Qwen2 (q/k/v biases, 7:1) and Mistral-style
(head_dim 128) models in fp32 and bf16, at page sizes 16 and 64. A CPU without the interpreter
is refused, naming the setting. (This CPU's own torch kernels happen to give these shapes
bit-identical hits too; the kernels' invariance is shown on its own in
tests/test_attention_numerics.py and here for the matmul, and on CUDA, where cuBLAS and flash
attention are not invariant, by tests/test_parity_gpu.py.)"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from kvtier.engine import attention, fused, fused_proj, invariant
from kvtier.engine.hf import CausalLM, _cache_arg, load_tokenizer
from kvtier.engine.prefix import PrefixCache
from kvtier.engine.presets import resolve_model
from kvtier.engine.request import PrefillReport
from kvtier.errors import ConfigError
from test_engine_support import make_config

SHAPE = dict(hidden_size=128, intermediate_size=192, num_hidden_layers=2, vocab_size=1024,
             max_position_embeddings=4096, tie_word_embeddings=False)
ARCHS = {
    "llama": lambda: LlamaConfig(num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                 **SHAPE),
    "qwen2": lambda: Qwen2Config(num_attention_heads=7, num_key_value_heads=1, head_dim=64,
                                 use_sliding_window=False, **SHAPE),
    "mistral": lambda: MistralConfig(num_attention_heads=2, num_key_value_heads=2, head_dim=128,
                                     sliding_window=None, **SHAPE),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def deterministic_lm(arch: str, dtype: str, seed: int = 0, *, device: str = "cpu",
                     deterministic: bool = True) -> CausalLM:
    """A random-weight ``arch`` model set up as ``hf.load_model`` sets it up."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(ARCHS[arch](), dtype=DTYPES[dtype],
                                                 attn_implementation="sdpa").eval()
    with torch.no_grad():   # random biases, so that Qwen2's are not all zero
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
    if device == "cuda":
        attention.install(model)
        fused.install_norms(model)
        fused_proj.install(model)
    if deterministic:
        invariant.install(model, torch.device(device))
    return CausalLM(f"det-{arch}", model, load_tokenizer(resolve_model("tiny-llama")),
                    torch.device(device), dtype, f"det-{arch}-{dtype}-{seed}-{deterministic}", (),
                    _cache_arg(model))


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def test_a_row_of_the_matmul_does_not_depend_on_the_others():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(80, 130, generator=gen).bfloat16()
    bias = torch.randn(80, generator=gen).bfloat16()
    x = torch.randn(70, 130, generator=gen).bfloat16()
    whole = invariant.linear(x, weight, bias)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 67), slice(64, 70)):
        assert torch.equal(invariant.linear(x[rows], weight, bias), whole[rows])
    want = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    assert float((whole.float() - want).abs().max()) <= 0.02 * float(want.abs().max())


def _uncached(lm: CausalLM, prompt: list[int]) -> torch.Tensor:
    return lm.forward(torch.tensor(prompt), lm.new_cache())


def _through(cache: PrefixCache, prompt: list[int]) -> tuple[torch.Tensor, PrefillReport]:
    report = PrefillReport(len(prompt))
    kv, logits, state = cache.prefill(prompt, None, report)
    cache.commit_prompt(state, prompt, kv)
    cache.finish(state, prompt, kv)
    cache.settle()
    return logits, report


@pytest.mark.parametrize(("arch", "dtype", "page_size"), [
    ("llama", "bfloat16", 16), ("qwen2", "bfloat16", 64), ("mistral", "float32", 16),
    ("llama", "float32", 64),
])
def test_hits_are_bit_identical_to_a_recompute(arch, dtype, page_size, tmp_path, monkeypatch):
    monkeypatch.setattr(invariant, "SPLIT_TOKENS", 64)   # several slices in short prompts
    lm = deterministic_lm(arch, dtype)
    # q/k/v and gate/up run fused, through the invariant GEMM, in the hits and the recompute
    groups = fused_proj.fused_groups(lm.model)
    assert len(groups) == 2 * lm.config.num_hidden_layers
    assert all(group.linear is invariant.linear for group in groups)
    config = make_config(cache__page_size=page_size, engine__dtype=dtype,
                         engine__deterministic="true")
    cache = PrefixCache.build(config, lm)
    try:
        prompt = _tokens(150, 1)
        want = _uncached(lm, prompt)
        # a first prompt sharing 100 tokens: the hit then covers its full pages only
        _through(cache, prompt[:100] + _tokens(20, 2))
        got, report = _through(cache, prompt)
        assert report.cached_tokens == 100 - 100 % page_size
        assert torch.equal(got, want), "device hit"
        cache.drop_tiers(("device",))
        got, report = _through(cache, prompt)
        assert report.cached_by_tier["host"] == 150 - 150 % page_size
        assert torch.equal(got, want), "host hit"
    finally:
        cache.close()


def test_plain_cpu_is_refused(monkeypatch):
    monkeypatch.setattr(invariant, "INTERPRET", False)
    with pytest.raises(ConfigError, match="engine.deterministic"):
        invariant.check_device(torch.device("cpu"))


def test_the_setting_reaches_the_model():
    from kvtier.config import build_config
    from kvtier.engine import paged
    from kvtier.engine.hf import load_model

    assert build_config(env={}, flags={}).engine.deterministic == "auto"
    config = build_config(env={}, flags={"engine.deterministic": "true"})
    lm = load_model("tiny-llama", device="cpu", dtype="float32",
                    deterministic=config.engine.deterministic)
    assert lm.deterministic
    # the invariant attention, wrapped by the batched engine's paged attention
    assert lm.model.config._attn_implementation == f"{paged.NAME}_{invariant.NAME}"
    linears = [m for m in lm.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all("forward" in m.__dict__ for m in linears)
    plain = load_model("tiny-llama", device="cpu", dtype="float32")
    assert invariant.NAME not in plain.model.config._attn_implementation
    assert not plain.deterministic
    # auto: on with CUDA, off on the CPU (the CPU would need the Triton interpreter)
    auto = load_model("tiny-llama", device="cpu", dtype="float32", deterministic="auto")
    assert not auto.deterministic
    assert invariant.NAME not in auto.model.config._attn_implementation
    # pages keyed apart: a hit under the invariant kernels only continues their own pages
    from kvtier.engine.prefix import kv_fingerprint

    assert kv_fingerprint(plain) == plain.fingerprint == lm.fingerprint
    assert kv_fingerprint(lm) == f"{lm.fingerprint}+{invariant.KERNELS}"


def test_auto_is_on_with_cuda_only():
    from kvtier.engine.hf import resolve_deterministic

    assert resolve_deterministic("auto", "cuda") is True
    assert resolve_deterministic("auto", "cuda:1") is True
    assert resolve_deterministic("auto", "cpu") is False
    assert resolve_deterministic("false", "cuda") is False
    assert resolve_deterministic("true", "cpu") is True
    with pytest.raises(ConfigError, match="engine.deterministic"):
        resolve_deterministic("yes", "cuda")
