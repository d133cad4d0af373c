"""Does a cache hit give a recompute's answer? Greedy tokens and logits, hit against no cache.

For each architecture (random weights built here: Llama GQA 4:1 head_dim 128, Qwen2 with q/k/v
biases GQA 7:1 head_dim 64, Mistral-style GQA 2:1 head_dim 128), dtype and mode (``default``:
the engine's fast path, on CUDA the kvtier attention, fused kernels and captured graphs;
``deterministic``: ``engine.deterministic``), it runs ``--prompts`` prompts that share long
prefixes three ways: without a cache, then through ``PrefixCache`` after a sibling prompt
committed the shared prefix (a device hit), then again after the device tier was dropped (a
host hit), for every page size. Each cell (arch, dtype, page size, tier, mode) reports the share
of prompts whose ``--new-tokens`` greedy tokens are identical, the max and mean |dlogit| over
the steps up to the first divergence, the first divergent position, and ``identical`` (every
prompt's tokens equal) and ``bit_identical`` (every logit equal).

On the CPU the deterministic mode needs ``TRITON_INTERPRET=1`` and is slow (keep it small);
the commands of the committed runs (``benchmarks/results/parity_cpu*``) and of the H200 run
are in README ("Numerics"). The text tables there are this script's stdout. Main thread.
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from kvtier.config import build_config
from kvtier.engine import attention, fused, invariant
from kvtier.engine.hf import DTYPES, CausalLM, _cache_arg, load_tokenizer
from kvtier.engine.prefix import PrefixCache
from kvtier.engine.presets import resolve_model
from kvtier.engine.request import PrefillReport
from kvtier.machine import format_table, write_report

ARCHS = {
    "llama": (LlamaConfig, dict(num_attention_heads=8, num_key_value_heads=2, head_dim=128)),
    "qwen2": (Qwen2Config, dict(num_attention_heads=7, num_key_value_heads=1, head_dim=64,
                                use_sliding_window=False)),
    "mistral": (MistralConfig, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                    sliding_window=None)),
}
VOCAB = 1024


def build_lm(arch: str, dtype: str, mode: str, device: str, hidden: int, layers: int) -> CausalLM:
    """A random-weight model of ``arch`` set up as the engine sets it up for ``mode``."""
    config_cls, heads = ARCHS[arch]
    config = config_cls(hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                        vocab_size=VOCAB, max_position_embeddings=1 << 15,
                        tie_word_embeddings=False, **heads)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype],
                                                 attn_implementation="sdpa").eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0.0, 0.5)
    if device == "cuda":   # as hf.load_model does with the kvtier attention
        attention.install(model)
        fused.install_norms(model)
    if mode == "deterministic":
        invariant.install(model, torch.device(device))
    return CausalLM(f"parity-{arch}", model, load_tokenizer(resolve_model("tiny-llama")),
                    torch.device(device), dtype, f"parity-{arch}-{dtype}-{mode}", (), _cache_arg(model))


Run = tuple[list[int], list[torch.Tensor]]   # greedy tokens, the logits of each step


def _greedy(lm: CausalLM, kv: Any, logits: torch.Tensor, new_tokens: int) -> Run:
    tokens, steps = [int(torch.argmax(logits))], [logits]
    while len(tokens) < new_tokens:
        logits = lm.forward(torch.tensor(tokens[-1:], device=lm.device), kv)
        tokens.append(int(torch.argmax(logits)))
        steps.append(logits)
    return tokens, steps


def _uncached(lm: CausalLM, prompt: list[int], new_tokens: int) -> Run:
    kv = lm.new_cache()
    logits = lm.forward(torch.tensor(prompt, device=lm.device), kv)
    return _greedy(lm, kv, logits, new_tokens)


def _through(cache: PrefixCache, prompt: list[int], new_tokens: int) -> Run:
    report = PrefillReport(len(prompt))
    kv, logits, state = cache.prefill(prompt, None, report)
    cache.commit_prompt(state, prompt, kv)
    out = _greedy(cache.lm, kv, logits, new_tokens)
    cache.finish(state, prompt + out[0][:-1], kv)
    cache.settle()
    return out


def compare(want: Run, got: Run) -> dict[str, Any]:
    """First divergent position (-1: none) and |dlogit| over the steps up to it."""
    first = next((i for i, (a, b) in enumerate(zip(want[0], got[0], strict=True)) if a != b), -1)
    upto = len(want[0]) if first < 0 else first + 1
    gaps = [(w.float() - g.float()).abs() for w, g in zip(want[1][:upto], got[1][:upto], strict=True)]
    return {"first_divergent": first, "max_dlogit": max(float(g.max()) for g in gaps),
            "mean_dlogit": statistics.fmean(float(g.mean()) for g in gaps)}


def prompts(count: int, length: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, sibling) pairs: the sibling shares a prefix of a random length with the prompt."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt = [rng.randrange(10, VOCAB) for _ in range(length)]
        shared = rng.randrange(length // 4, length)
        out.append((prompt, prompt[:shared] + [rng.randrange(10, VOCAB) for _ in range(16)]))
    return out


def run_cells(args: argparse.Namespace, arch: str, dtype: str, mode: str) -> list[dict[str, Any]]:
    lm = build_lm(arch, dtype, mode, args.device, args.hidden, args.layers)
    pairs = prompts(args.prompts, args.prompt_tokens, args.seed)
    wants = [_uncached(lm, prompt, args.new_tokens) for prompt, _ in pairs]
    cells = []
    for page_size in args.page_sizes:
        flags = {"engine.device": args.device, "engine.dtype": dtype, "cache.page_size": page_size,
                 "engine.deterministic": str(mode == "deterministic").lower(),
                 "cache.device_pages": args.device_pages, "host.pool_bytes": "256MiB",
                 "host.pinned_budget_bytes": "512MiB"}
        cache = PrefixCache.build(build_config(env={}, flags=flags), lm)
        results: dict[str, list[dict[str, Any]]] = {"device": [], "host": []}
        try:
            for (prompt, sibling), want in zip(pairs, wants, strict=True):
                cache.drop_tiers(("device", "host"))
                _through(cache, sibling, 1)
                results["device"].append(compare(want, _through(cache, prompt, args.new_tokens)))
                cache.drop_tiers(("device",))
                results["host"].append(compare(want, _through(cache, prompt, args.new_tokens)))
        finally:
            cache.close()
        for tier, rows in results.items():
            cells.append(_cell(arch, dtype, page_size, tier, mode, rows))
    return cells


def _cell(arch: str, dtype: str, page_size: int, tier: str, mode: str,
          rows: list[dict[str, Any]]) -> dict[str, Any]:
    same = [r["first_divergent"] < 0 for r in rows]
    divergent = [r["first_divergent"] for r in rows if r["first_divergent"] >= 0]
    max_dlogit = max(r["max_dlogit"] for r in rows)
    return {"arch": arch, "dtype": dtype, "page_size": page_size, "tier": tier, "mode": mode,
            "prompts": len(rows), "identical_share": sum(same) / len(rows),
            "max_dlogit": max_dlogit, "mean_dlogit": statistics.fmean(r["mean_dlogit"] for r in rows),
            "first_divergent": min(divergent) if divergent else -1,
            "identical": all(same), "bit_identical": all(same) and max_dlogit == 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--archs", default="llama,qwen2,mistral")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--modes", default="default,deterministic")
    parser.add_argument("--page-sizes", default="16,64")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=160)
    parser.add_argument("--new-tokens", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--device-pages", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    args.page_sizes = [int(p) for p in args.page_sizes.split(",")]
    cells = [cell for arch in args.archs.split(",") for dtype in args.dtypes.split(",")
             for mode in args.modes.split(",") for cell in run_cells(args, arch, dtype, mode)]
    keys = ["arch", "dtype", "page_size", "tier", "mode", "prompts", "identical_share",
            "max_dlogit", "mean_dlogit", "first_divergent", "identical", "bit_identical"]
    print(format_table(keys, [[cell[k] for k in keys] for cell in cells]))
    if args.out:
        settings = {k: v for k, v in vars(args).items() if k != "out"}
        write_report(args.out, "parity", {"settings": settings, "cells": cells})


if __name__ == "__main__":
    main()
