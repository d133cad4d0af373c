"""kvtier's reference engine against a real CUDA vLLM: one script, one GPU, the same model and prompts.

Both engines run on the same machine, each case in a fresh process (``--case``), an
8B-shaped model (``--preset llama3-8b-shape``, random weights: vLLM ``load_format="dummy"``,
kvtier a seeded preset), bf16, seeded random prompts of ids 5..1000 (the same ids for both
engines where both run a prompt: ``vllm_gpu_case.prompt``). Cases:

- ``kernel``: the paged prefill kernel (``kvtier.engine.paged_triton``) against
  ``F.scaled_dot_product_attention`` (flash backend, causal, K/V repeated to every query head
  in contiguous tensors, so it reads no pages) on one layer's shape at each of
  ``--lengths``, TFLOP/s of the causal work (``4 * heads * head_dim * L(L+1)/2``), page
  sizes 64 and 16, a 32k prompt in the engine's 8192-token steps; then the numerics contract
  on the GPU: a prompt computed whole, in steps of several sizes and as a hit's suffix (the
  flash kernel and the split launch) must give bit-identical outputs (``bitwise`` rows);
- ``kvtier``: kvtier's engine in-process (``EngineService``, no HTTP): TTFT of recompute,
  device hit and host hit at ``--lengths`` (``kvtier.bench.ttft.TtftRun``: a prefix of L
  tokens plus a fresh 32-token suffix, kvtier off as the recompute, medians of
  ``--repeats``); then generated tokens/s for 16 and 64 concurrent ~4,980-token prompts with
  128 new tokens each, and the decode inter-token latency at batch 1 and 16;
- ``kvtier_det``: the same with ``engine.deterministic`` on (batch-invariant kernels in every
  forward: the mode whose hits are bit-identical to a recompute on the GPU), reported against
  ``kvtier`` (what exactness costs);
- ``vllm_main``: vLLM 0.26 (its default torch.compile + CUDA graphs, prefix caching on):
  recompute TTFT (prompts it has not seen), GPU prefix hit (same prefix, fresh 32-token
  suffix), the same throughput and inter-token latency runs;
- ``vllm_native``: vLLM with native CPU offloading (``kv_offloading_backend="native"``):
  store the prompt, reset the GPU prefix cache, time the host hit (same prefix, fresh suffix).

TTFT is wall time from submit to the first token (vLLM: ``LLM.generate`` with
``max_tokens=1``). Inter-token latency at batch B is ``(T(B prompts, 129 new) - T(B other
prompts, 1 new)) / 128``: the same difference on both engines, so prefill and launch costs
cancel. Throughput is generated tokens over the wall time of the whole batch. Ratios are
kvtier / vLLM; the goal column gives the target ratio (TTFT and latency: lower is better;
throughput: higher).

Run (vLLM from ``../shared/tools/vllm-gpu``'s kit, ``. /tmp/vg/env.sh`` first)::

    python3 benchmarks/engine/engine_vs_vllm.py --out /tmp/evv                 # every case
    python3 benchmarks/engine/engine_vs_vllm.py --out /tmp/evv --cases kernel,kvtier
    python3 benchmarks/engine/engine_vs_vllm.py --out /tmp/evv --kernel-only

Each case writes ``<out>/cases/<case>.json`` when it ends (a failed one records its error and
the tail of its output, and the run goes on); every run then prints the table over all case
files under ``--out`` (so cases may run in separate commands) and writes
``<out>/engine_vs_vllm.json`` (machine, settings, cases, table) and ``<out>/cases.log`` (every
child's output).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm"))    # vllm_gpu, vllm_gpu_case
                                                                           # (another folder)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))   # batching_gpu (another folder)

import vllm_gpu
import vllm_gpu_case
from vllm_gpu_case import emit, log, prompt

CASES = ("kernel", "kvtier", "kvtier_det", "vllm_main", "vllm_native")
SUFFIX_TOKENS = 32                       # a hit's new tokens (kvtier bench ttft's default)
NEW_TOKENS = vllm_gpu_case.THROUGHPUT_NEW     # 128 generated tokens a throughput or ITL prompt
ITL_BATCHES = (1, 16)
#: Goals (kvtier / vLLM), from the engine's targets: TTFT and latency at most, throughput at
#: least.
GOALS = {"recompute": ("<=", 1.1), "device_hit": ("<=", 1.0), "host_hit": ("<=", 0.8),
         "throughput": (">=", 0.9), "itl_1": ("<=", 1.1), "itl_16": ("<=", None)}


def attempt(res: dict[str, Any], key: str, fn: Any) -> Any:
    """``res[key] = fn()``; a failure is recorded as ``res[key + "_error"]`` (with its
    traceback in the case's log) and the case goes on to its next measurement."""
    try:
        res[key] = fn()
        return res[key]
    except Exception as exc:
        res[f"{key}_error"] = f"{type(exc).__name__}: {exc}"[:1000]
        print(traceback.format_exc()[-4000:], flush=True)
        log(f"{key} FAILED: {res[key + '_error']}")
        return None


def median_ms(values: list[float]) -> float | None:
    return round(statistics.median(values) * 1e3, 2) if values else None


def throughput_prompts(level: int, length: int) -> list[list[int]]:
    return [prompt(length, seed=level * 1000 + i) for i in range(level)]


def itl_prompts(batch: int, length: int, tag: int) -> list[list[int]]:
    return [prompt(length, seed=900_000 + tag * 10_000 + batch * 100 + i) for i in range(batch)]


def itl_from(run: Any, batch: int, length: int, repeats: int) -> dict[str, Any]:
    """``run(prompts, new)`` returns wall seconds; the decode step time at ``batch``."""
    short, long_ = [], []
    for r in range(repeats):
        short.append(run(itl_prompts(batch, length, 2 * r), 1))
        long_.append(run(itl_prompts(batch, length, 2 * r + 1), NEW_TOKENS + 1))
    ms = (statistics.median(long_) - statistics.median(short)) / NEW_TOKENS * 1e3
    return {"batch": batch, "prompt_tokens": length, "itl_ms": round(ms, 3),
            "wall_1_new_s": [round(x, 4) for x in short],
            f"wall_{NEW_TOKENS + 1}_new_s": [round(x, 4) for x in long_]}


# ================================================================================================
# case: the kernel alone
# ================================================================================================
def kernel_case(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from kvtier.engine import paged_prefill_split, paged_triton
    from kvtier.engine.presets import PRESETS

    config = PRESETS[args.preset].config
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    dtype, device = torch.bfloat16, torch.device(args.device)   # cpu: TRITON_INTERPRET=1
    scale = dim ** -0.5
    n_rep = heads // kv_heads
    gen = torch.Generator(device=device).manual_seed(0)

    def pages_for(length: int, page: int) -> tuple[Any, Any, Any]:
        count = -(-length // page)
        k = torch.randn((count, page, kv_heads, dim), generator=gen, device=device, dtype=dtype)
        v = torch.randn((count, page, kv_heads, dim), generator=gen, device=device, dtype=dtype)
        order = torch.randperm(count, generator=gen, device=device)   # scattered pages
        return k, v, order.to(torch.int32)[None]

    def tiles(start: int, count: int) -> Any:
        per = paged_triton.tokens_per_tile(n_rep)
        rows = [(0, off, min(per, count - off), start + off) for off in range(0, count, per)]
        return torch.as_tensor(rows, dtype=torch.int32, device=device)

    def paged(q: Any, k: Any, v: Any, table: Any, start: int, out: Any, t: Any = None) -> Any:
        t = tiles(start, q.shape[0]) if t is None else t   # built outside timed loops
        return paged_triton.paged_attention(q, k, v, table, t, scale,
                                            paged_triton.tokens_per_tile(n_rep), out)

    def timed(fn: Any, iters: int) -> float:
        fn()
        if device.type != "cuda":   # a dry run of the script on the CPU
            started = time.perf_counter()
            fn()
            return (time.perf_counter() - started) * 1e3
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / iters

    def causal_tflops(length: int, ms: float) -> float:
        pairs = length * (length + 1) // 2          # (query, key) pairs a causal prompt has
        return round(4 * heads * dim * pairs / (ms * 1e-3) / 1e12, 1)

    def sdpa_time(q4: Any, k4: Any, v4: Any, iters: int) -> tuple[Any, float, str]:
        def call() -> Any:
            return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return call(), timed(call, iters), "flash"
        except Exception as exc:   # no flash backend here: whatever sdpa picks
            return call(), timed(call, iters), f"default ({type(exc).__name__})"

    def measure(q: Any, page: int) -> dict[str, Any]:
        length = q.shape[0]
        iters = max(3, min(50, (1 << 27) // (length * length // 64 + 1)))
        k, v, table = pages_for(length, page)
        out = torch.empty_like(q)
        whole = tiles(0, length)
        paged_ms = timed(lambda: paged(q, k, v, table, 0, out, whole), iters)
        slots = (table[0].long()[:, None] * page + torch.arange(page, device=device))
        slots = slots.reshape(-1)[:length]
        k4 = k.reshape(-1, kv_heads, dim)[slots].transpose(0, 1)[None]
        v4 = v.reshape(-1, kv_heads, dim)[slots].transpose(0, 1)[None]
        want, sdpa_ms, backend = sdpa_time(
            q.transpose(0, 1)[None], k4.repeat_interleave(n_rep, 1).contiguous(),
            v4.repeat_interleave(n_rep, 1).contiguous(), iters)
        err = (out.float() - want[0].transpose(0, 1).float()).abs().max().item()
        row = {"tokens": length, "page_size": page, "paged_ms": round(paged_ms, 3),
               "paged_tflops": causal_tflops(length, paged_ms), "sdpa_backend": backend,
               "sdpa_ms": round(sdpa_ms, 3), "sdpa_tflops": causal_tflops(length, sdpa_ms),
               "paged_over_sdpa_time": round(paged_ms / sdpa_ms, 3),
               "max_abs_diff_vs_sdpa": err}
        if length >= 16384 and page == 64:   # the engine's 8192-token prefill steps
            step = 8192
            steps = [(s, tiles(s, min(step, length - s))) for s in range(0, length, step)]

            def stepped() -> None:
                for s, t in steps:
                    paged(q[s:s + step], k, v, table, s, out[s:s + step], t)
            chunk_ms = timed(stepped, max(3, iters // 2))
            row["in_8192_steps_ms"] = round(chunk_ms, 3)
            row["in_8192_steps_tflops"] = causal_tflops(length, chunk_ms)
        return row

    rows: list[dict[str, Any]] = []
    for length in args.lengths:
        q = torch.randn((length, heads, dim), generator=gen, device=device, dtype=dtype)
        for page in (64, 16):
            rows.append(measure(q, page))
            log(f"kernel {json.dumps(rows[-1])}")
            if device.type == "cuda":
                torch.cuda.empty_cache()

    # the numerics contract on the GPU: whole, stepped, suffix (flash and split launch)
    bitwise: dict[str, bool] = {}
    for check_dtype, extra in ((torch.bfloat16, 8192), (torch.float32, 2048)):
        label = "bf16" if check_dtype == torch.bfloat16 else "fp32"
        total, page = min(extra, max(args.lengths)) + 777, 64
        q = torch.randn((total, heads, dim), generator=gen, device=device).to(check_dtype)
        k, v, table = (t.to(check_dtype) if t.is_floating_point() else t
                       for t in pages_for(total, page))
        whole = paged(q, k, v, table, 0, torch.full_like(q, float("nan")))
        for size in (8192, 2048, 1000, 333, 97):
            parts = [paged(q[s:s + size], k, v, table, s,
                           torch.full_like(q[s:s + size], float("nan")))
                     for s in range(0, total, size)]
            bitwise[f"{label}_steps_of_{size}"] = bool(torch.equal(torch.cat(parts), whole))
        for past in sorted({p for p in (8192, total - 100, total - 32, total - 7)
                            if 0 < p < total}):
            suffix = paged(q[past:], k, v, table, past, torch.full_like(q[past:], float("nan")))
            bitwise[f"{label}_flash_suffix_after_{past}"] = bool(torch.equal(suffix,
                                                                             whole[past:]))
            if total - past <= 32:
                t = tiles(past, total - past)
                parts_buf = paged_prefill_split.partials(
                    t.shape[0], kv_heads, -(-total // paged_triton.CHUNK_TOKENS), dim, device)
                split = paged_prefill_split.split_prefill(
                    q[past:], k, v, table, t, scale, torch.full_like(q[past:], float("nan")),
                    parts_buf)
                bitwise[f"{label}_split_suffix_after_{past}"] = bool(torch.equal(split,
                                                                                 whole[past:]))
    log(f"kernel bitwise {bitwise}")
    tuned = getattr(getattr(paged_triton, "_tuned_kernel", None), "cache", {}) or {}
    best = {str(key): str(config) for key, config in tuned.items()} or None
    return {"rows": rows, "bitwise": bitwise, "bitwise_all": all(bitwise.values()),
            "autotune_best": best,
            "shape": {"heads": heads, "kv_heads": kv_heads, "head_dim": dim, "dtype": "bf16"}}


# ================================================================================================
# case: kvtier's engine
# ================================================================================================
def kvtier_case(args: argparse.Namespace, deterministic: bool = False) -> dict[str, Any]:
    import torch

    from batching_gpu import _generate_all, _service, _timed_concurrent
    from kvtier.bench.ttft import TtftPlan, TtftRun, summarize
    from kvtier.config import build_config
    from kvtier.engine.hf import load_model

    res: dict[str, Any] = {}
    started = time.perf_counter()
    lm = load_model(args.preset, device=args.device, dtype=args.dtype, deterministic=deterministic)
    res["load_s"] = round(time.perf_counter() - started, 1)
    host_pool = f"{int(args.offload_gib)}GiB"
    pinned = f"{2 * int(args.offload_gib) + 4}GiB"   # two TTFT services hold a host pool each
    flags = {"engine.model": args.preset, "engine.device": args.device, "engine.dtype": args.dtype,
             "host.pool_bytes": host_pool, "host.pinned_budget_bytes": pinned,
             "cache.device_memory_fraction": str(args.kvtier_ttft_fraction),
             "engine.deterministic": str(deterministic).lower()}
    config = build_config(env={}, flags=flags)

    class SameIds(TtftRun):
        """kvtier bench ttft's run over prompt ids from vLLM's range."""

        def tokens(self, n: int) -> list[int]:
            return [self.rng.randrange(vllm_gpu_case.TOKEN_LOW, vllm_gpu_case.TOKEN_HIGH) for _ in range(n)]

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

    service = _service(lm, args.device, args.dtype, max(args.levels), host_pool,
                       device_fraction=args.kvtier_device_fraction,
                       extra={"host.pinned_budget_bytes": pinned,
                              "engine.deterministic": str(deterministic).lower()})
    try:
        _generate_all(service, [prompt(64, seed=990 + i) for i in range(2)], 8)   # warm-up
        graphs = service.engine.decode_graphs
        if graphs is not None:   # capture now (on the engine thread), not on the clock
            keys = args.throughput_prompt + NEW_TOKENS
            service.scheduler.call_soon(
                lambda: graphs.warm(service.engine.pages.kv, keys)).result(timeout=600)
        _timed_concurrent(service, [prompt(args.throughput_prompt, seed=995 + i) for i in range(2)],
                          NEW_TOKENS)                                            # warm-up
        res["throughput"], res["itl"] = {}, {}
        for level in args.levels:
            one = attempt(res["throughput"], str(level), lambda level=level: _timed_concurrent(
                service, throughput_prompts(level, args.throughput_prompt), NEW_TOKENS))
            if one:
                one["gen_tok_s"] = one["tokens_per_s"]
            log(f"kvtier throughput {level}: {one}")
            emit("PARTIAL", **res)

        def run(prompts: list[list[int]], new: int) -> float:
            return float(_timed_concurrent(service, prompts, new)["seconds"])

        for b in ITL_BATCHES:
            attempt(res["itl"], str(b),
                    lambda b=b: itl_from(run, b, args.itl_prompt, args.itl_repeats))
        log(f"kvtier itl {res['itl']}")
        res["engine_stats"] = service.engine.stats()
    finally:
        service.close()
    return res


# ================================================================================================
# cases: vLLM
# ================================================================================================
def vllm_args(args: argparse.Namespace, case: str) -> argparse.Namespace:
    """The settings ``vllm_gpu_case.Case`` reads."""
    return argparse.Namespace(
        case=case, mode="graphs", model_dir=args.model_dir, dtype=args.dtype,
        max_model_len=max(args.lengths) + 256, block_size=args.vllm_block_size,
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


# ================================================================================================
# child and parent
# ================================================================================================
def child_main(args: argparse.Namespace) -> None:
    res: dict[str, Any] = {"case": args.case, "ok": False}
    code = 0
    try:
        if args.case == "kernel":
            res.update(kernel_case(args))
        elif args.case in ("kvtier", "kvtier_det"):
            res.update(kvtier_case(args, deterministic=args.case == "kvtier_det"))
        else:
            res.update(vllm_case(args, args.case))
        res["ok"] = True
    except BaseException as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        print(traceback.format_exc()[-6000:], flush=True)
        code = 1
    emit("RESULT", **res)
    sys.stdout.flush()
    os._exit(code)           # skip interpreter teardown (engine threads can hang it)


def run_case(args: argparse.Namespace, case: str, timeout_s: float, logf: Any) -> dict[str, Any]:
    """One case in a fresh process; a partial result (``@@PARTIAL``) survives a crash or kill."""
    partial: dict[str, Any] = {}
    done = vllm_gpu.run_child(args, case, "graphs", timeout_s, logf, script=__file__)
    logf.flush()
    log_text = (Path(args.out) / "cases.log").read_text(errors="replace")
    for line in log_text.split(f"===== {case} / graphs =====")[-1].splitlines():
        if line.startswith("@@PARTIAL "):
            partial = json.loads(line[len("@@PARTIAL "):])
    if not done.get("ok"):
        done = {**partial, **done, "partial": bool(partial)}
    done["case"] = case
    return done


def ratio(a: Any, b: Any) -> float | None:
    ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and b
    return round(a / b, 3) if ok else None


def table(args: argparse.Namespace, cases: dict[str, dict[str, Any]]) -> tuple[str, list[Any]]:
    from kvtier.machine import format_table

    kv, main, native = (cases.get(c, {}) for c in ("kvtier", "vllm_main", "vllm_native"))
    rows: list[dict[str, Any]] = []

    def add(metric: str, goal_key: str, unit: str, ours: Any, theirs: Any) -> None:
        sense, target = GOALS[goal_key]
        r = ratio(ours, theirs)
        met = None
        if r is not None and target is not None:
            met = r <= target if sense == "<=" else r >= target
        rows.append({"metric": metric, "unit": unit, "kvtier": ours, "vllm": theirs,
                     "kvtier_over_vllm": r,
                     "goal": f"{sense} {target}" if target is not None else "-",
                     "met": met})

    for length in args.lengths:
        k = kv.get("ttft", {}).get(str(length), {})
        m = main.get("ttft", {}).get(str(length), {})
        n = native.get("ttft", {}).get(str(length), {})
        add(f"TTFT recompute {length}", "recompute", "ms", k.get("recompute_ms"),
            m.get("recompute_ms"))
        add(f"TTFT device hit {length}", "device_hit", "ms", k.get("device_hit_ms"),
            m.get("device_hit_ms"))
        add(f"TTFT host hit {length} (vLLM: native offload)", "host_hit", "ms",
            k.get("host_hit_ms"), n.get("host_hit_ms"))
    for level in args.levels:
        add(f"throughput {level} x {args.throughput_prompt} tok, {NEW_TOKENS} new", "throughput",
            "gen tok/s", kv.get("throughput", {}).get(str(level), {}).get("gen_tok_s"),
            main.get("throughput", {}).get(str(level), {}).get("gen_tok_s"))
    for batch in ITL_BATCHES:
        add(f"decode inter-token latency, batch {batch}", f"itl_{batch}", "ms",
            kv.get("itl", {}).get(str(batch), {}).get("itl_ms"),
            main.get("itl", {}).get(str(batch), {}).get("itl_ms"))
    verdict = {True: "met", False: "MISSED", None: "-"}
    engines = [c for c in ("kvtier", "vllm_main", "vllm_native") if c in cases]
    headers = ["metric", "unit", "kvtier", "vLLM", "kvtier/vLLM", "goal", "verdict"]
    text = "" if not engines else format_table(
        headers, [[r["metric"], r["unit"], _cell(r["kvtier"]), _cell(r["vllm"]),
                          _cell(r["kvtier_over_vllm"]), r["goal"], verdict[r["met"]]]
                         for r in rows])
    det = cases.get("kvtier_det", {})
    if det:
        text += "\n\n" if text else ""
        text += "kvtier's engine.deterministic (batch-invariant kernels) against its default:\n"
        text += format_table(["metric", "unit", "default", "deterministic", "det/default"],
                             [[m, u, _cell(a), _cell(b), _cell(ratio(b, a))]
                              for m, u, a, b in deterministic_rows(args, kv, det)])
    kernel = cases.get("kernel", {})
    if kernel.get("rows"):
        text += "\n\n" if text else ""
        text += "paged prefill kernel vs sdpa (one layer, causal, bf16, " \
                f"{kernel.get('shape')}; autotune: {kernel.get('autotune_best')}):\n"
        text += format_table(
            ["tokens", "page", "paged ms", "paged TFLOP/s", "sdpa ms", "sdpa TFLOP/s",
             "paged/sdpa time", "8192-steps ms", "steps TFLOP/s", "max |diff|"],
            [[r["tokens"], r["page_size"], r["paged_ms"], r["paged_tflops"], r["sdpa_ms"],
              r["sdpa_tflops"], r["paged_over_sdpa_time"], _cell(r.get("in_8192_steps_ms")),
              _cell(r.get("in_8192_steps_tflops")), f"{r['max_abs_diff_vs_sdpa']:.3g}"]
             for r in kernel["rows"]])
        text += f"\nbit-identical whole / stepped / suffix: {kernel.get('bitwise_all')} " \
                f"{kernel.get('bitwise')}"
    for warning in hit_warnings(args, cases):
        text += f"\nWARNING: {warning}"
    return text, rows


def deterministic_rows(args: argparse.Namespace, kv: dict[str, Any],
                       det: dict[str, Any]) -> list[tuple[str, str, Any, Any]]:
    """(metric, unit, default, deterministic) for what both kvtier cases measured."""
    rows = []
    for length in args.lengths:
        for key, name in (("recompute_ms", "recompute"), ("device_hit_ms", "device hit"),
                          ("host_hit_ms", "host hit")):
            rows.append((f"TTFT {name} {length}", "ms",
                         kv.get("ttft", {}).get(str(length), {}).get(key),
                         det.get("ttft", {}).get(str(length), {}).get(key)))
    for level in args.levels:
        rows.append((f"throughput {level} x {args.throughput_prompt} tok", "gen tok/s",
                     kv.get("throughput", {}).get(str(level), {}).get("gen_tok_s"),
                     det.get("throughput", {}).get(str(level), {}).get("gen_tok_s")))
    for batch in ITL_BATCHES:
        rows.append((f"decode inter-token latency, batch {batch}", "ms",
                     kv.get("itl", {}).get(str(batch), {}).get("itl_ms"),
                     det.get("itl", {}).get(str(batch), {}).get("itl_ms")))
    return rows


def hit_warnings(args: argparse.Namespace, cases: dict[str, dict[str, Any]]) -> list[str]:
    """Hits that did not come from the cache they were meant to (their TTFT is no hit's)."""
    out = []
    for case, field in (("kvtier", "device_hit"), ("kvtier", "host_hit"),
                        ("vllm_main", "device_hit"), ("vllm_native", "host_hit")):
        for length in args.lengths:
            cached = cases.get(case, {}).get("ttft", {}).get(str(length), {}).get(f"{field}_cached")
            if cached and min(c or 0 for c in cached) < length - 64:
                out.append(f"{case} {field} at {length} tokens reused only {cached} tokens")
    return out


def _cell(value: Any) -> Any:
    return "-" if value is None else value


def load_cases(out: Path) -> dict[str, dict[str, Any]]:
    cases = {}
    for path in sorted((out / "cases").glob("*.json")):
        try:
            data = json.loads(path.read_text())
            cases[data["case"]] = data
        except (OSError, ValueError, KeyError):
            continue
    return cases


def parent_main(args: argparse.Namespace) -> None:
    from kvtier.machine import write_report

    out = Path(args.out)
    (out / "cases").mkdir(parents=True, exist_ok=True)
    if any(c.startswith("vllm") for c in args.cases):
        vllm_gpu.build_model_dir(args.preset, Path(args.model_dir))
    deadline = time.monotonic() + args.budget_s
    with open(out / "cases.log", "a") as logf:
        for case in args.cases:
            left = deadline - time.monotonic()
            if left < 30:
                result: dict[str, Any] = {"case": case, "ok": False, "error": "no time left"}
            else:
                log(f"case {case} ({left:.0f} s left)")
                result = run_case(args, case, min(left, args.case_timeout_s), logf)
                logf.flush()
            if not result.get("ok"):
                log(f"case {case} FAILED: {result.get('error')}")
            (out / "cases" / f"{case}.json").write_text(
                json.dumps(result, indent=1, default=str) + "\n")
    cases = load_cases(out)
    text, rows = table(args, cases)
    gpus = _gpu_names()
    header = (f"engine_vs_vllm on {gpus}: {args.preset}, {args.dtype}, random weights; kvtier/vLLM "
              f"< 1 means kvtier is faster for times, slower for tok/s. Cases: "
              + ", ".join(f"{c}={'ok' if d.get('ok') else 'FAILED: ' + str(d.get('error'))[:120]}"
                          for c, d in cases.items()))
    for c, d in cases.items():
        for where, message in sub_errors(d):
            header += f"\n  {c}: {where} failed: {message[:200]}"
    print("\n" + header + "\n\n" + text)
    (out / "engine_vs_vllm.txt").write_text(header + "\n\n" + text + "\n")
    write_report(out / "engine_vs_vllm.json", "engine_vs_vllm", {
        "gpu": gpus,
        "settings": {k: v for k, v in vars(args).items() if k != "child_argv"},
        "table": rows, "cases": cases})
    print(f"wrote {out / 'engine_vs_vllm.json'} and {out / 'engine_vs_vllm.txt'}")


def sub_errors(data: Any, where: str = "") -> list[tuple[str, str]]:
    """Every ``*_error`` a case recorded (a measurement that failed while the case went on)."""
    out: list[tuple[str, str]] = []
    if isinstance(data, dict):
        for key, value in data.items():
            if key.endswith("_error"):
                out.append((f"{where}{key[:-6]}", str(value)))
            else:
                out += sub_errors(value, f"{where}{key}.")
    return out


def _gpu_names() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return ", ".join(torch.cuda.get_device_name(i)
                             for i in range(torch.cuda.device_count()))
    except Exception:   # a report, whatever the machine
        pass
    return "no CUDA device"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="results directory")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--kernel-only", action="store_true", help="only the kernel micro-benchmark")
    p.add_argument("--case", choices=CASES, help="(internal) run one case in this process")
    p.add_argument("--mode", default="graphs", help="(internal)")
    p.add_argument("--preset", default="llama3-8b-shape")
    p.add_argument("--model-dir", default="/tmp/kvtier_evv_model")
    p.add_argument("--lengths", default="4096,32768")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--levels", default="16,64", help="concurrent prompts of the throughput runs")
    p.add_argument("--throughput-prompt", type=int, default=vllm_gpu_case.THROUGHPUT_PROMPT,
                   help="prompt tokens of the throughput runs")
    p.add_argument("--device", default="cuda", help="kvtier's device (cpu: a dry run of the script)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--itl-prompt", type=int, default=2048, help="prompt tokens of the ITL runs")
    p.add_argument("--itl-repeats", type=int, default=2)
    p.add_argument("--offload-gib", type=float, default=12.0,
                   help="vLLM's native CPU offloading and kvtier's host tier")
    p.add_argument("--vllm-block-size", type=int, default=16,
                   help="vLLM's KV block (16 on CUDA; its CPU build needs a multiple of 32)")
    p.add_argument("--vllm-gpu-mem", type=float, default=0.85,
                   help="vLLM gpu_memory_utilization (weights + activations + KV)")
    p.add_argument("--kvtier-device-fraction", type=float, default=0.75,
                   help="kvtier's page pool share of the free device memory (throughput runs)")
    p.add_argument("--kvtier-ttft-fraction", type=float, default=0.3,
                   help="each of the two TTFT services' page pool share (kvtier bench ttft's)")
    p.add_argument("--budget-s", type=float, default=540.0, help="all cases of this run")
    p.add_argument("--case-timeout-s", type=float, default=330.0)
    args = p.parse_args(argv)
    args.child_argv = [a for a in argv if a != "--kernel-only"]
    args.lengths = [int(x) for x in str(args.lengths).split(",") if x]
    args.levels = [int(x) for x in str(args.levels).split(",") if x]
    args.cases = ["kernel"] if args.kernel_only else \
        [c for c in str(args.cases).split(",") if c]
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        p.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    return args


def main() -> None:
    args = parse_args(sys.argv[1:])
    if args.case:
        child_main(args)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
