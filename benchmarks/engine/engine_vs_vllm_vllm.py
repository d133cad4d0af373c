"""``engine_vs_vllm.py``'s vLLM cases: ``vllm_main`` (vLLM with its default compilation and
prefix caching: recompute TTFT, GPU prefix hit, throughput, inter-token latency) and
``vllm_native`` (vLLM's native CPU offloading: the host hit), each through ``vllm_gpu_case.Case``
with this benchmark's settings. The main thread of the child process (``engine_vs_vllm.py
--case vllm_main``) runs it; vLLM's engine runs in-process.

Imports ``vllm_gpu_case`` from ``benchmarks/vllm``: ``engine_vs_vllm.py`` puts that folder on
``sys.path``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import vllm_gpu_case
from engine_vs_vllm_measure import (
    ITL_BATCHES,
    NEW_TOKENS,
    SUFFIX_TOKENS,
    attempt,
    itl_from,
    median_ms,
    throughput_prompts,
)
from vllm_gpu_case import emit, log, prompt


def vllm_args(args: argparse.Namespace, case: str) -> argparse.Namespace:
    """The settings ``vllm_gpu_case.Case`` reads."""
    return argparse.Namespace(
        case=case, mode="graphs", model_dir=args.model_dir, dtype=args.dtype,
        # every prompt the case runs fits: the TTFT lengths, and the throughput and ITL
        # prompts with their generated tokens
        max_model_len=max(*args.lengths, args.throughput_prompt, args.itl_prompt)
        + vllm_gpu_case.THROUGHPUT_NEW + 256, block_size=args.vllm_block_size,
        gpu_mem=args.vllm_gpu_mem,
        max_num_seqs=max(args.levels), offload_gib=args.offload_gib, host_gib=int(args.offload_gib),
        staging_pages=0, lengths=args.lengths, check_lengths=[], repeats=args.repeats,
        unseen=1, batch=0)


def vllm_many(case: Any, prompts: list[list[int]], new: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, detokenize=False)
    started = time.perf_counter()
    outs = case.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    if got != new * len(prompts):
        raise RuntimeError(f"vLLM generated {got} tokens, expected {new * len(prompts)}")
    return seconds


def vllm_case(args: argparse.Namespace, name: str) -> dict[str, Any]:
    case = vllm_gpu_case.Case(vllm_args(args, "alone" if name == "vllm_main" else "native"))
    case.build()
    res: dict[str, Any] = {"versions": case.res.get("versions"), "init_s": case.res.get("init_s"),
                           "ttft": {}}
    cache_config = case.llm.llm_engine.vllm_config.cache_config
    if cache_config.num_gpu_blocks:      # the KV capacity vLLM sized for itself
        res["kv_tokens"] = int(cache_config.num_gpu_blocks) * int(cache_config.block_size)
    # Tokens one step runs at most (its default depends on the GPU's memory and the entry point)
    res["step_tokens"] = int(case.llm.llm_engine.vllm_config.scheduler_config
                             .max_num_batched_tokens)
    case.gen(prompt(args.lengths[0], seed=7), 1)                     # warm-up

    def ttft_at(length: int) -> dict[str, Any]:
        prefix = prompt(length, seed=1)
        suffixes = [prompt(SUFFIX_TOKENS, seed=100 + i) for i in range(args.repeats + 2)]
        r: dict[str, Any] = {}
        if name == "vllm_main":
            case.gen(prompt(length + SUFFIX_TOKENS, seed=2), 1)    # warm this length
            miss = [case.gen(prompt(length + SUFFIX_TOKENS, seed=10 + i), 1)
                    for i in range(args.repeats)]
            r["recompute_ms"] = median_ms([t for t, _, _ in miss])
            r["recompute_cached"] = [c for _, _, c in miss]
            case.gen(prefix + suffixes[0], 1)                         # store
            hits = [case.gen(prefix + s, 1) for s in suffixes[1:1 + args.repeats]]
            r["device_hit_ms"] = median_ms([t for t, _, _ in hits])
            r["device_hit_cached"] = [c for _, _, c in hits]
        else:
            warm = prompt(length, seed=3)                             # warm the offload path
            case.gen(warm + suffixes[0], 1)
            case.drop_gpu_copies()
            case.gen(warm + suffixes[1], 1)
            case.gen(prefix + suffixes[0], 1)                         # store
            hits = []
            for s in suffixes[1:1 + args.repeats]:
                case.drop_gpu_copies()
                hits.append(case.gen(prefix + s, 1))
            r["host_hit_ms"] = median_ms([t for t, _, _ in hits])
            r["host_hit_cached"] = [c for _, _, c in hits]
        log(f"{name} {length}: {r}")
        return r

    for length in args.lengths:
        attempt(res["ttft"], str(length), lambda length=length: ttft_at(length))
        emit("PARTIAL", **res)
    if name == "vllm_main":
        vllm_many(case, [prompt(args.throughput_prompt, seed=995 + i) for i in range(2)],
                  NEW_TOKENS)
        res["throughput"], res["itl"] = {}, {}

        def throughput_at(level: int) -> dict[str, Any]:
            seconds = vllm_many(case, throughput_prompts(level, args.throughput_prompt),
                                NEW_TOKENS)
            out = {"requests": level, "seconds": round(seconds, 3),
                   "generated_tokens": level * NEW_TOKENS,
                   "gen_tok_s": round(level * NEW_TOKENS / seconds, 1)}
            log(f"{name} throughput {level}: {out}")
            return out

        for level in args.levels:
            attempt(res["throughput"], str(level), lambda level=level: throughput_at(level))
            emit("PARTIAL", **res)
        for b in ITL_BATCHES:
            attempt(res["itl"], str(b), lambda b=b: itl_from(
                lambda p, n: vllm_many(case, p, n), b, args.itl_prompt, args.itl_repeats))
        log(f"{name} itl {res['itl']}")
    return res
