"""Adapter over a Hugging Face causal LM (transformers 5.x): load, fingerprint, forward with a cache.

Owns ``CausalLM``: builds a preset with random weights from a seed or loads a model directory,
names its KV layout and fingerprint (what goes into the page-key namespace), makes
``DynamicCache`` objects and runs the forward pass over new tokens with the past in a cache.
Position ids always cover past + new tokens; the causal mask is left to transformers, which
builds it over past + new from the cache length (a mask over the new tokens alone would give
wrong logits silently). Runs on the engine thread only.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.engine import kv_pages
from kvtier.engine.presets import ModelSource, resolve_model
from kvtier.errors import ConfigError
from kvtier.layout import KVLayout

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAMPLE = 64  # elements taken from each end of every weight for the fingerprint


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("engine.device", device, "cpu (no CUDA device is visible)")
    return device


def resolve_deterministic(value: str | bool, device: str) -> bool:
    """``engine.deterministic`` on ``device`` (resolved): ``auto`` is on with CUDA only."""
    if isinstance(value, bool):
        return value
    if value == "auto":
        return device.startswith("cuda")
    if value not in ("true", "false"):
        raise ConfigError("engine.deterministic", value, "auto, true or false")
    return value == "true"


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    if dtype not in DTYPES:
        raise ConfigError("engine.dtype", dtype, ", ".join(DTYPES))
    return dtype


@dataclass
class CausalLM:
    """A loaded model, its tokenizer and the facts the cache needs about it."""

    name: str
    model: Any
    tokenizer: Any
    device: torch.device
    dtype_name: str
    fingerprint: str
    eos_token_ids: tuple[int, ...]
    cache_arg: str = "cache"
    deterministic: bool = False     # kvtier.engine.invariant's kernels serve every forward
    #: The paged forwards' kernels (``paged.backend_of``: torch, triton or fa3); None: chosen
    #: on first use with ``engine.prefill_attention`` auto.
    paged_backend: str | None = None
    paged_backend_why: str = ""

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    @property
    def max_positions(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 0) or 1 << 20)

    def kv_layout(self, page_size: int) -> KVLayout:
        return KVLayout(self.config.num_hidden_layers, self.num_kv_heads, self.head_dim,
                        self.dtype_name, page_size)

    @property
    def num_kv_heads(self) -> int:
        cfg = self.config
        return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)

    @property
    def head_dim(self) -> int:
        cfg = self.config
        return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)

    def new_cache(self) -> Any:
        """An empty ``DynamicCache`` whose layers grow in place (``kv_pages.RoomyLayer``)."""
        from transformers import DynamicCache

        return kv_pages.roomy_layers(DynamicCache(config=self.config))

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, cache: Any, *, all_logits: bool = False) -> torch.Tensor:
        """Run ``token_ids`` (1-D, on the model's device) after the ``cache.get_seq_length()``
        tokens already in ``cache`` (mutated in place). Returns the last position's logits as
        ``[vocab]`` fp32, or every position's as ``[n, vocab]`` with ``all_logits``."""
        past = cache.get_seq_length()
        new = token_ids.shape[0]
        if past + new > self.max_positions:
            raise ValueError(f"{past + new} positions exceed the model's {self.max_positions}")
        positions = torch.arange(past, past + new, device=self.device).unsqueeze(0)
        # One unpadded sequence: transformers builds the causal mask over past + new tokens from
        # the cache length. A mask of ones would be equivalent but is checked with ``.all()``,
        # a device sync that would stall the recompute half of a hybrid load on CUDA.
        kwargs = {self.cache_arg: cache, "position_ids": positions, "attention_mask": None,
                  "use_cache": True, "logits_to_keep": 0 if all_logits else 1}
        out = self.model(input_ids=token_ids.unsqueeze(0), **kwargs)
        logits = out.logits[0].float()
        return logits if all_logits else logits[-1]


def load_model(model: str, *, device: str = "auto", dtype: str = "auto", seed: int = 0,
               attention: str = "kvtier", deterministic: bool | str = False,
               prefill_attention: str = "auto") -> CausalLM:
    """Build a preset (random weights from ``seed``) or load a model directory onto ``device``.
    ``attention="kvtier"`` installs ``kvtier.engine.attention`` (split-KV kernels for short
    suffixes over a long past on CUDA; transformers' sdpa for everything else) and, on CUDA,
    the fused RMSNorm, rotary embedding and SiLU·mul and the fused projections (q/k/v and
    gate/up as one GEMM each) for every forward (the captured hit path runs them: the prefill
    must too).
    ``deterministic`` (a bool, or ``engine.deterministic``'s auto/true/false) installs
    ``kvtier.engine.invariant`` (batch-invariant kernels, the fused projections among them).
    ``prefill_attention`` (``engine.prefill_attention``) picks the paged forwards' prompt
    attention on CUDA: FlashAttention 3 where ``auto`` finds it fit, else the Triton kernels
    (``paged.backend_of``); logged once."""
    source = resolve_model(model)
    device = resolve_device(device)
    deterministic = resolve_deterministic(deterministic, device)
    dtype = resolve_dtype(dtype, device)
    hf_model = _build(source, torch.device(device), DTYPES[dtype], seed)
    hf_model.eval()
    _check_supported(hf_model.config)
    if attention == "kvtier" and device.startswith("cuda"):
        from kvtier.engine import attention as split_kv
        from kvtier.engine import fused, fused_proj

        split_kv.install(hf_model)
        fused.install_norms(hf_model)
        fused.install_rotary(hf_model)
        fused.install_mlps(hf_model)
        fused_proj.install(hf_model)   # cuBLAS; the deterministic mode's GEMM replaces it below
    if deterministic:
        from kvtier.engine import invariant

        invariant.install(hf_model, torch.device(device))
    from kvtier.engine import paged

    paged.install(hf_model)  # many sequences in one forward over the device pool's pages
    tokenizer = load_tokenizer(source)
    fingerprint = model_fingerprint(hf_model, seed if source.is_preset else None)
    lm = CausalLM(source.name, hf_model, tokenizer, torch.device(device), dtype, fingerprint,
                  _eos_ids(hf_model.config, tokenizer), _cache_arg(hf_model), deterministic)
    backend = paged.backend_of(lm, prefill_attention)
    if lm.device.type == "cuda":
        log.info("prefill attention: %s (%s)", backend, lm.paged_backend_why)
    return lm


def _cache_arg(model: Any) -> str:
    """The cache keyword of forward: ``cache`` in newer transformers, ``past_key_values`` before."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _build(source: ModelSource, device: torch.device, dtype: torch.dtype, seed: int) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    if source.path is not None:
        loaded = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=dtype,
                                                      attn_implementation="sdpa")
        return loaded.to(device)
    config_dict = dict(source.config or {})
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)
    with device:
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")


def _check_supported(config: Any) -> None:
    sliding = getattr(config, "sliding_window", None)
    if sliding and getattr(config, "use_sliding_window", True):
        raise ConfigError("engine.model", getattr(config, "model_type", "?"),
                          "a model with full attention (sliding-window attention is not supported)")


def load_tokenizer(source: ModelSource) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(source.tokenizer_dir))


def _eos_ids(config: Any, tokenizer: Any) -> tuple[int, ...]:
    ids: set[int] = set()
    for value in (getattr(config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))


def model_fingerprint(model: Any, seed: int | None) -> str:
    """SHA-256 over the config, the seed (presets) and samples of every weight: two models
    that differ in any of them never share KV pages."""
    digest = hashlib.sha256()
    config = model.config.to_dict()
    config.pop("transformers_version", None)
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(f"seed={seed}".encode())
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            flat = tensor.detach().reshape(-1)
            sample = torch.cat([flat[:_SAMPLE], flat[-_SAMPLE:]]).float().cpu()
            digest.update(name.encode() + str(tuple(tensor.shape)).encode())
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:32]
