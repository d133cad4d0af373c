"""kvtier's batched engine against transformers' own continuous batching, in one process and run.

Both generate greedily, ignoring EOS, for the same prompts on the same model (random weights
from the same seed): kvtier through ``EngineService`` (continuous batching over its paged
device pool; all requests submitted at once, ``engine.max_running`` = the request count, the
cache on), transformers through ``model.generate_batch`` (``transformers.generation.
continuous_batching``: its paged cache and scheduler, sdpa attention). Each side runs a short
warm-up first. Prints a table and writes ``--json`` with machine info. Usage (the H200):

    PYTHONPATH=src python benchmarks/serve/batching_peer.py --model llama3-8b-shape --device cuda \\
        --dtype bfloat16 --requests 16 --prompt-tokens 5000 --new-tokens 128 \\
        --json benchmarks/results/batching_peer_h200.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from kvtier.config import build_config
from kvtier.engine.hf import load_model
from kvtier.engine.request import GenerationRequest
from kvtier.engine.service import EngineService
from kvtier.machine import format_table, machine_info


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(length)] for _ in range(count)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_kvtier(args: argparse.Namespace, lm, prompts: list[list[int]]) -> tuple[float, int]:
    config = build_config(env={}, flags={"engine.device": args.device, "engine.dtype": args.dtype,
                                         "engine.max_running": str(len(prompts)),
                                         "host.pool_bytes": args.host_pool})
    service = EngineService.build(config, lm=lm)
    try:
        for warm in _prompts(2, 16, 99):
            service.generate(GenerationRequest(tuple(warm), 4), timeout=600)
        started = time.perf_counter()
        handles = [service.submit(GenerationRequest(tuple(p), args.new_tokens)) for p in prompts]
        tokens = sum(len(h.result(timeout=3600)[0]) for h in handles)
        _sync(args.device)
        return time.perf_counter() - started, tokens
    finally:
        service.close()


def time_generate_batch(model, prompts: list[list[int]], new_tokens: int,
                        warm: list[list[int]]) -> tuple[float, int]:
    """transformers' continuous batching (sdpa), after a warm-up on ``warm``: seconds, tokens."""
    from transformers import GenerationConfig

    model.set_attn_implementation("sdpa")
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                              pad_token_id=0)
    model.generate_batch(warm, generation_config=config)
    _sync(str(model.device))
    started = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=config)
    _sync(str(model.device))
    return time.perf_counter() - started, sum(len(o.generated_tokens) for o in out.values())


def run_transformers(args: argparse.Namespace, lm, prompts: list[list[int]]) -> tuple[float, int]:
    return time_generate_batch(lm.model, prompts, args.new_tokens, _prompts(2, 16, 99))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--host-pool", default="64MiB")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    prompts = _prompts(args.requests, args.prompt_tokens, 0)
    rows, result = [], {"machine": machine_info(), "settings": vars(args) | {"json": None}}
    for name, runner in (("kvtier", run_kvtier), ("transformers generate_batch", run_transformers)):
        seconds, tokens = runner(args, lm, prompts)
        result[name] = {"seconds": round(seconds, 3), "generated_tokens": tokens,
                        "tokens_per_s": round(tokens / seconds, 2)}
        rows.append([name, tokens, f"{seconds:.2f}", f"{tokens / seconds:.1f}"])
    ratio = result["kvtier"]["tokens_per_s"] / result["transformers generate_batch"]["tokens_per_s"]
    result["kvtier_over_transformers"] = round(ratio, 2)
    text = format_table(["engine", "generated", "seconds", "tokens/s"], rows)
    text += f"\nkvtier / transformers: {ratio:.2f}x"
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
        args.json.with_suffix(".txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
