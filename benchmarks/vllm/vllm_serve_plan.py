"""``vllm_serve.py``'s workloads and memory plan: the seeded shared-prefix and multi-turn
requests and the warm-up, a workload's working set (its distinct full blocks plus its outputs),
KV bytes per token, and the GPU KV cache, kvtier's staging pages and the host size every server
gets (the rules are in ``vllm_serve.py``'s doc). The main thread runs it, before the first
server starts.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from vllm_gpu_case import TOKEN_HIGH

WORKLOADS = ("shared-prefix", "multi-turn")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


def log(msg: str) -> None:
    print(f"[serve] {msg}", flush=True)

def build_workloads(args: argparse.Namespace) -> dict[str, list[Any]]:
    from kvtier.bench.serve_workloads import conversations, shared_prefix

    out: dict[str, list[Any]] = {}
    if "shared-prefix" in args.workloads:
        out["shared-prefix"] = shared_prefix(
            args.groups * args.rounds, args.groups, args.prefix_len, args.suffix_len,
            args.output_len, TOKEN_HIGH, seed=args.seed)
    if "multi-turn" in args.workloads:
        out["multi-turn"] = conversations(
            args.conversations, args.turns, args.system_len, args.user_len, args.output_len,
            args.output_len, TOKEN_HIGH, seed=args.seed)
    return out


def warmup_requests(args: argparse.Namespace) -> list[Any]:
    from kvtier.bench.serve_workloads import random_prompts

    return random_prompts(args.concurrency, 4 * args.block_size, 8, TOKEN_HIGH,
                          seed=args.seed + 7919)


def working_set_tokens(requests: list[Any], block: int) -> int:
    """Tokens the workload would keep cached: its prompts' distinct full blocks (a block is
    known by its whole prefix, as prefix caches key it) plus every output token."""
    seen: set[int] = set()
    for r in requests:
        key = 0
        for start in range(0, len(r.prompt) - block + 1, block):
            key = hash((key, r.prompt[start:start + block]))
            seen.add(key)
    return len(seen) * block + sum(r.max_tokens for r in requests)


def kv_bytes_per_token(preset: str, dtype: str) -> int:
    from kvtier.engine.presets import PRESETS

    c = PRESETS[preset].config or {}
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    return int(c["num_hidden_layers"] * heads * head_dim * 2 * DTYPE_BYTES[dtype])


def plan_memory(args: argparse.Namespace, workloads: dict[str, list[Any]]) -> dict[str, Any]:
    """The GPU KV cache, kvtier's staging pages and the host size (see ``vllm_serve.py``'s doc)."""
    per_token = kv_bytes_per_token(args.preset, args.dtype)
    sets = {name: working_set_tokens(reqs, args.block_size) for name, reqs in workloads.items()}
    longest = max(len(r.prompt) + r.max_tokens for reqs in workloads.values() for r in reqs)
    longest_prompt = max(len(r.prompt) for reqs in workloads.values() for r in reqs)
    staging = args.staging_pages or args.concurrency * -(-longest_prompt // args.block_size)
    staging_tokens = 0 if args.kvtier_extra_gpu else staging * args.block_size
    by_fraction = math.ceil(args.gpu_kv_fraction * max(sets.values()))
    inflight = math.ceil(args.inflight_headroom * args.concurrency * longest) + staging_tokens
    tokens = max(by_fraction, inflight)
    tokens = -(-tokens // args.block_size) * args.block_size
    reason = "fraction of the working set" if by_fraction >= inflight else "requests in flight"
    gpu_bytes = tokens * per_token
    if args.gpu_kv_bytes:
        gpu_bytes, reason = int(args.gpu_kv_bytes), "--gpu-kv-bytes"
    staging_bytes = staging * args.block_size * per_token
    host_gib = args.host_gib or round(math.ceil(1.5 * max(sets.values()) * per_token / 2**30 * 4)
                                      / 4, 2)
    plan = {"kv_bytes_per_token": per_token, "working_set_tokens": sets,
            "longest_request_tokens": longest, "gpu_kv_tokens": gpu_bytes // per_token,
            "gpu_kv_bytes": gpu_bytes, "gpu_kv_chosen_by": reason, "host_gib": host_gib,
            "gpu_share_of_working_set": {n: round(gpu_bytes / per_token / s, 3)
                                         for n, s in sets.items()},
            "max_model_len": -(-(longest + 64) // 256) * 256,
            # kvtier's staging pages (one page per vLLM block) sit on the GPU beside vLLM's KV
            # cache: they hold a hit between the host tier and vLLM's blocks and a prompt being
            # stored, and serve as kvtier's device tier. Unless --kvtier-extra-gpu they come out
            # of kvtier's share, so every server has the same GPU memory for KV.
            "kvtier_staging_pages": staging, "kvtier_staging_bytes": staging_bytes,
            "kvtier_vllm_kv_bytes": gpu_bytes - (0 if args.kvtier_extra_gpu else staging_bytes)}
    if plan["kvtier_vllm_kv_bytes"] < args.concurrency * longest * per_token:
        log("warning: kvtier's vLLM KV cache cannot hold the requests in flight (preemption)")
    if gpu_bytes // per_token >= max(sets.values()):
        log("warning: the GPU KV cache holds a whole working set; offloading cannot help")
    return plan
