"""``engine_vs_vllm.py``'s ``kvtier`` and ``kvtier_det`` cases: kvtier's engine in-process
(``EngineService``, no HTTP): TTFT of recompute, device hit and host hit (``kvtier bench
ttft``'s run over vLLM's prompt ids), generated tokens/s at each concurrency level and the
decode inter-token latency, with ``engine.deterministic`` off or on; and where its GPU memory
went (``gpu_memory``: weights, page pool, the rest at the throughput runs' peak). The main
thread of the child process (``engine_vs_vllm.py --case kvtier``) runs it; the engine runs on
its own thread, as in ``kvtier serve``.

Imports ``batching_gpu`` (``benchmarks/serve``) and ``vllm_gpu_case`` (``benchmarks/vllm``):
``engine_vs_vllm.py`` puts both folders on ``sys.path``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from engine_vs_vllm_measure import (
    ITL_BATCHES,
    NEW_TOKENS,
    SUFFIX_TOKENS,
    attempt,
    itl_from,
    throughput_prompts,
)
from vllm_gpu_case import TOKEN_HIGH, TOKEN_LOW, emit, log, prompt


def kvtier_case(args: argparse.Namespace, deterministic: bool = False) -> dict[str, Any]:
    import torch

    from batching_gpu import _generate_all, _service, _timed_concurrent
    from kvtier.bench.ttft import TtftPlan, TtftRun, summarize
    from kvtier.config import build_config
    from kvtier.engine.hf import load_model

    res: dict[str, Any] = {}
    if args.kvtier_tma:
        from kvtier.engine import paged_triton

        paged_triton.GPU_DESCRIPTORS = True
    started = time.perf_counter()
    lm = load_model(args.preset, device=args.device, dtype=args.dtype, deterministic=deterministic,
                    prefill_attention=args.kvtier_set.get("engine.prefill_attention", "auto"))
    res["load_s"] = round(time.perf_counter() - started, 1)
    res["prefill_attention"] = lm.paged_backend
    host_pool = f"{int(args.offload_gib)}GiB"
    pinned = f"{2 * int(args.offload_gib) + 4}GiB"   # two TTFT services hold a host pool each
    flags = {"engine.model": args.preset, "engine.device": args.device, "engine.dtype": args.dtype,
             "host.pool_bytes": host_pool, "host.pinned_budget_bytes": pinned,
             "cache.device_memory_fraction": str(args.kvtier_ttft_fraction),
             "engine.deterministic": str(deterministic).lower(), **args.kvtier_set}
    config = build_config(env={}, flags=flags)

    class SameIds(TtftRun):
        """kvtier bench ttft's run over prompt ids from vLLM's range."""

        def tokens(self, n: int) -> list[int]:
            return [self.rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n)]

    ttft_run = SameIds(config, lm, TtftPlan(prefix_tokens=tuple(args.lengths),
                                            tiers=("device", "host"), repeats=args.repeats,
                                            suffix_tokens=SUFFIX_TOKENS),
                       progress=lambda label: log(f"kvtier ttft {label}"))
    attempt(res, "ttft_run", lambda: ttft_run.run() or "done")
    res["ttft_summary"] = summarize(ttft_run)
    ttft: dict[str, Any] = {}
    for row in res["ttft_summary"]["rows"]:
        key = {"recompute": "recompute", "device": "device_hit", "host": "host_hit"}[row["tier"]]
        ttft.setdefault(str(row["prefix_tokens"]), {})[f"{key}_ms"] = round(row["ttft_s"] * 1e3, 2)
        if row["tier"] != "recompute":
            ttft[str(row["prefix_tokens"])][f"{key}_cached_by_tier"] = row["cached_by_tier"]
            ttft[str(row["prefix_tokens"])][f"{key}_cached"] = [row["cached_tokens"]]
    res["ttft"] = ttft
    emit("PARTIAL", **res)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    extra = {"host.pinned_budget_bytes": pinned,
             "engine.deterministic": str(deterministic).lower(), **args.kvtier_set}
    if args.kvtier_step_tokens > 0:   # vLLM's tokens per step: prefill chunks of the same size
        extra.setdefault("engine.prefill_chunk_tokens", str(args.kvtier_step_tokens))
    if args.kvtier_kv_tokens > 0:     # vLLM's KV capacity, in kvtier's pages, where it fits
        pages = -(-args.kvtier_kv_tokens // config.cache.page_size)
        fits = fitting_pages(args, config, lm)
        if fits is not None and fits < pages:
            log(f"kvtier: vLLM's {args.kvtier_kv_tokens} KV tokens do not fit beside the "
                f"engine's workspaces; {fits * config.cache.page_size} instead")
            res["kv_tokens_capped_from"] = args.kvtier_kv_tokens
            pages = fits
        extra["cache.device_pages"] = str(pages)
    service = _service(lm, args.device, args.dtype, max(args.levels), host_pool,
                       device_fraction=args.kvtier_device_fraction, extra=extra)
    pages = service.engine.pages
    pool = getattr(getattr(pages, "tiered", pages), "device_pool", None)
    res["kv_tokens"] = pool.num_pages * config.cache.page_size if pool is not None else None
    res["step_tokens"] = service.config.engine.prefill_chunk_tokens
    try:
        _generate_all(service, [prompt(64, seed=990 + i) for i in range(2)], 8)   # warm-up
        graphs = service.engine.decode_graphs
        if graphs is not None:   # capture now (on the engine thread), not on the clock
            for keys in (args.throughput_prompt + NEW_TOKENS, args.itl_prompt + NEW_TOKENS + 1):
                service.scheduler.call_soon(
                    lambda keys=keys: graphs.warm(service.engine.pages.kv, keys)
                ).result(timeout=600)
        _timed_concurrent(service, [prompt(args.throughput_prompt, seed=995 + i) for i in range(2)],
                          NEW_TOKENS)                                            # warm-up
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        res["throughput"], res["itl"] = {}, {}
        for level in args.levels:
            one = attempt(res["throughput"], str(level), lambda level=level: _timed_concurrent(
                service, throughput_prompts(level, args.throughput_prompt), NEW_TOKENS))
            if one:
                one["gen_tok_s"] = one["tokens_per_s"]
            log(f"kvtier throughput {level}: {one}")
            emit("PARTIAL", **res)
        log(f"kvtier GPU memory {attempt(res, 'gpu_memory', lambda: gpu_memory(lm, pool))}")

        def run(prompts: list[list[int]], new: int) -> float:
            return float(_timed_concurrent(service, prompts, new)["seconds"])

        for b in ITL_BATCHES:
            attempt(res["itl"], str(b),
                    lambda b=b: itl_from(run, b, args.itl_prompt, args.itl_repeats))
        log(f"kvtier itl {res['itl']}")
        if graphs is not None:      # the look-ahead against steps one at a time, both ways
            res.update(_itl_ahead(service, graphs, run, args))
        res["engine_stats"] = service.engine.stats()
    finally:
        service.close()
    return res


def gpu_memory(lm: Any, pool: Any) -> dict[str, float] | None:
    """Where the engine's GPU memory went by the end of the throughput runs, in GiB: the
    weights, the KV page pool, the rest at the peak of those runs (prefill activations,
    decode and suffix graphs, workspaces) and what the caching allocator held beyond what was
    allocated; None off CUDA."""
    import torch

    if not torch.cuda.is_available() or lm.device.type != "cuda":
        return None
    gib = float(1 << 30)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()   # views (fused
                for t in lm.model.parameters()}                           # q/k/v) count once
    weights = sum(storages.values())
    kv = pool.nbytes if pool is not None else 0
    peak = torch.cuda.max_memory_allocated()
    free, total = torch.cuda.mem_get_info()
    return {"weights_gib": round(weights / gib, 2), "kv_pool_gib": round(kv / gib, 2),
            "other_at_peak_gib": round((peak - weights - kv) / gib, 2),
            "cached_unallocated_gib": round((torch.cuda.memory_reserved()
                                             - torch.cuda.memory_allocated()) / gib, 2),
            "free_gib": round(free / gib, 2), "total_gib": round(total / gib, 2)}


def fitting_pages(args: argparse.Namespace, config: Any, lm: Any) -> int | None:
    """kvtier pages that fit in ``--kvtier-device-fraction`` of the device memory free now (the
    rest is the engine's workspace: prefill chunks, decode and suffix graphs); None off CUDA."""
    import torch

    if not torch.cuda.is_available() or not str(args.device).startswith("cuda"):
        return None
    free, _ = torch.cuda.mem_get_info()
    return int(free * args.kvtier_device_fraction) // lm.kv_layout(config.cache.page_size).page_bytes


def _itl_ahead(service: Any, graphs: Any, run: Any, args: argparse.Namespace
               ) -> dict[str, Any]:
    """Decode ITL with the steps queued ahead (``engine.decode_ahead``), then one at a time
    again (the order's own drift shows as the two one-at-a-time runs' difference); each
    with prompts of its own."""
    from kvtier.engine.ahead import Lookahead

    engine, out = service.engine, {}
    for key, lookahead, variant in (("itl_ahead", Lookahead(graphs), 1),
                                    ("itl_one_at_a_time_again", None, 2)):
        service.scheduler.call_soon(
            lambda la=lookahead: setattr(engine, "lookahead", la)).result(timeout=60)
        out[key] = {}
        for b in ITL_BATCHES:
            attempt(out[key], str(b), lambda b=b, v=variant: itl_from(
                run, b, args.itl_prompt, args.itl_repeats, variant=v))
        if lookahead is not None:
            out["engine_stats_ahead"] = engine.stats()
        log(f"kvtier {key} {out[key]}")
    return out
