"""The batched engine on a GPU: correctness first, then generated tokens/s under concurrency.

Correctness (fp32, small random-weight models): every prompt's greedy tokens through
``EngineService`` are compared three ways -- generated alone, generated in one batch with all the
others, and by transformers' own ``generate`` with no kvtier at all -- and, after the first pass
cached the prompts, once more as prefix hits. Throughput (the model and dtype given, random
prompts, ``ignore_eos``): one stream alone (ms per generated token) and each concurrency of
``--concurrency`` submitted at once (generated tokens/s, TTFT p50), with transformers'
``generate_batch`` (continuous batching, sdpa) on the first concurrency for a side-by-side ratio.
Prints a table and writes ``--json`` with machine info. Usage (the H200)::

    PYTHONPATH=src python benchmarks/serve/batching_gpu.py --model llama3-8b-shape --dtype bfloat16 \\
        --prompt-tokens 5000 --new-tokens 128 --concurrency 16,64 --json batching_h200.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from batching_peer import time_generate_batch
from kvtier.config import build_config
from kvtier.engine.hf import load_model
from kvtier.engine.request import FinishEvent, GenerationRequest, TokenEvent
from kvtier.engine.service import EngineService
from kvtier.machine import format_table, machine_info

#: Share of free device memory for the page pool (``--device-fraction``; the server's default 0.3
#: holds 37 GB on the H200, less than 64 prompts of 5k tokens of an 8B model need).
DEVICE_FRACTION = 0.3


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _prompts(count: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 1) for _ in range(length)] for _ in range(count)]


def _service(lm: Any, device: str, dtype: str, max_running: int, host_pool: str,
             decode_graph_batch: int | None = None,
             device_fraction: float = DEVICE_FRACTION,
             extra: dict[str, str] | None = None) -> EngineService:
    flags = {"engine.device": device, "engine.dtype": dtype,
             "engine.max_running": str(max_running), "host.pool_bytes": host_pool,
             "cache.device_memory_fraction": str(device_fraction), **(extra or {})}
    if decode_graph_batch is not None:
        flags["engine.decode_graph_batch"] = str(decode_graph_batch)
    config = build_config(env={}, flags=flags)
    return EngineService.build(config, lm=lm)


def _generate_all(service: EngineService, prompts: list[list[int]], new: int) -> list[list[int]]:
    handles = [service.submit(GenerationRequest(tuple(p), new)) for p in prompts]
    return [h.result(timeout=1800)[0] for h in handles]


def check_model(model: str, device: str, prompts: int, length: int, new: int) -> dict[str, Any]:
    """Greedy tokens alone, batched, as hits and by transformers: the same for every prompt?"""
    lm = load_model(model, device=device, dtype="float32")
    vocab = lm.config.vocab_size
    # Shared heads so that the second pass has prefix hits of several lengths.
    base = _prompts(1, length, 7, vocab)[0]
    texts = [base[: length // 2 + 16 * i] + _prompts(1, 24, 100 + i, vocab)[0] for i in range(prompts)]
    reference = []
    for p in texts:
        ids = torch.tensor([p], device=lm.device)
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
        reference.append(out[0, len(p):].tolist())
    service = _service(lm, device, "float32", prompts, "256MiB")
    try:                                   # cold, all at once; then the same prompts as hits
        batched = _generate_all(service, texts, new)
        hits = _generate_all(service, texts, new)
    finally:
        service.close()
    service = _service(lm, device, "float32", prompts, "256MiB")
    try:                                   # each alone, on a fresh cache
        alone = [_generate_all(service, [p], new)[0] for p in texts]
    finally:
        service.close()
    same = {name: sum(a == r for a, r in zip(rows, reference, strict=True))
            for name, rows in (("alone", alone), ("batched", batched), ("hits", hits))}
    return {"model": model, "prompts": prompts, "identical_to_transformers": same,
            "all_identical": all(v == prompts for v in same.values())}


def _timed_concurrent(service: EngineService, prompts: list[list[int]], new: int) -> dict[str, Any]:
    """Submit ``prompts`` at once; each request's events are read on a thread of its own, so a
    first token is timed when it arrives, not when the reader reaches its request."""
    started = time.perf_counter()
    handles = [service.submit(GenerationRequest(tuple(p), new)) for p in prompts]

    def read(handle: Any) -> tuple[float, int, str | None]:
        first, count, error = None, 0, None
        for event in handle.events(1800):
            if not isinstance(event, TokenEvent):
                if isinstance(event, FinishEvent) and event.reason == "error":
                    error = f"{event.error_kind}: {event.error}"
                break
            first = first or time.perf_counter()
            count += 1
        return (first or time.perf_counter()) - started, count, error

    with ThreadPoolExecutor(max_workers=len(handles)) as pool:
        read_back = list(pool.map(read, handles))
    ttfts = [ttft for ttft, _, _ in read_back]
    tokens = sum(count for _, count, _ in read_back)
    errors = [error for _, _, error in read_back if error is not None]
    if errors:       # a rate over failed requests is no rate: the caller's run fails
        raise RuntimeError(f"{len(errors)} of {len(prompts)} requests failed, first: {errors[0]}")
    _sync()
    seconds = time.perf_counter() - started
    return {"requests": len(prompts), "generated_tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1),
            "ttft_p50_s": round(statistics.median(ttfts), 3)}


def _single(service: EngineService, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    one = _timed_concurrent(service, _prompts(1, args.prompt_tokens, 1, vocab), args.new_tokens)
    decode_s = one["seconds"] - one["ttft_p50_s"]
    one["ms_per_token"] = round(1000 * decode_s / max(1, one["generated_tokens"] - 1), 2)
    return one


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    extra = dict(item.split("=", 1) for item in args.set)
    lm = load_model(args.model, device=args.device, dtype=args.dtype,
                    deterministic=extra.get("engine.deterministic", "false") == "true")
    vocab = lm.config.vocab_size
    levels = [int(c) for c in args.concurrency.split(",")]
    service = _service(lm, args.device, args.dtype, max(levels), args.host_pool,
                       device_fraction=args.device_fraction, extra=extra)
    out: dict[str, Any] = {}
    try:
        _generate_all(service, _prompts(2, 64, 99, vocab), 8)        # warm-up
        graphs = service.engine.decode_graphs
        if graphs is not None:   # capture now (on the engine thread), not on the clock
            keys = args.prompt_tokens + args.new_tokens
            service.scheduler.call_soon(
                lambda: graphs.warm(service.engine.pages.kv, keys)).result(timeout=600)
        out["single"] = _single(service, args, vocab)
        for level in levels:
            out[f"concurrent_{level}"] = _timed_concurrent(
                service, _prompts(level, args.prompt_tokens, 1000 + level, vocab), args.new_tokens)
        out["engine_stats"] = service.engine.stats()
    finally:
        service.close()
    service = _service(lm, args.device, args.dtype, 1, args.host_pool, decode_graph_batch=0,
                       extra=extra)
    try:                         # the same stream without decode graphs, for the side by side
        _generate_all(service, _prompts(1, 64, 99, vocab), 8)
        out["single_eager_decode"] = _single(service, args, vocab)
    finally:
        service.close()
    if not args.skip_peer:
        prompts = _prompts(levels[0], args.prompt_tokens, 1000 + levels[0], vocab)
        seconds, tokens = time_generate_batch(lm.model, prompts, args.new_tokens,
                                              _prompts(2, 64, 99, vocab))
        out["transformers_generate_batch"] = {"requests": levels[0], "generated_tokens": tokens,
                                              "seconds": round(seconds, 3),
                                              "tokens_per_s": round(tokens / seconds, 1)}
        out["kvtier_over_transformers"] = round(
            out[f"concurrent_{levels[0]}"]["tokens_per_s"] / (tokens / seconds), 2)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b-shape")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=5000)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="16,64")
    parser.add_argument("--host-pool", default="8GiB")
    parser.add_argument("--check-models", default="tiny-llama,tiny-qwen2")
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--device-fraction", type=float, default=DEVICE_FRACTION)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a config field for the throughput runs, e.g. engine.deterministic=true "
                             "(which also loads the model with the batch-invariant kernels)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result: dict[str, Any] = {"machine": machine_info(), "settings": vars(args) | {"json": None}}
    result["correctness"] = [check_model(m, args.device, 6, 200, 24)
                             for m in args.check_models.split(",") if m]
    for row in result["correctness"]:
        print(row)
    result["throughput"] = throughput(args)
    rows = [[name, r.get("requests", ""), r.get("generated_tokens", ""), r.get("tokens_per_s", ""),
             r.get("ttft_p50_s", ""), r.get("ms_per_token", "")]
            for name, r in result["throughput"].items()
            if isinstance(r, dict) and name != "engine_stats"]
    text = format_table(["run", "requests", "generated", "tok/s", "TTFT p50 s", "ms/token"], rows)
    if "kvtier_over_transformers" in result["throughput"]:
        text += f"\nkvtier / transformers: {result['throughput']['kvtier_over_transformers']}x"
    print(text)
    print("engine:", result["throughput"].get("engine_stats"))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
        args.json.with_suffix(".txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
