"""Where a loaded engine's time goes: each step's forward, and the commits between steps.

Runs ``--concurrency`` random prompts at once through ``EngineService`` (as
``batching_gpu.py`` does) with the engine's step and the cache's commits timed on the engine
thread (the device synchronized around each, so a time is the GPU's as well as Python's). Steps
are grouped by kind (decode only, prefill only, mixed) and by tokens; the table shows their
count, total and mean seconds. A second part times the paged prefill kernel alone on one long
prompt against PyTorch's ``scaled_dot_product_attention`` over the same keys laid out
contiguously (flash attention on CUDA), per layer. Writes ``--json`` with machine info. Usage
(the H200)::

    PYTHONPATH=src python benchmarks/serve/step_profile.py --json step_profile_h200.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from batching_gpu import _prompts, _service, _timed_concurrent
from kvtier.engine import runner, seq_pages
from kvtier.engine.hf import load_model
from kvtier.machine import format_table, machine_info


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(log: list[tuple[str, int, float]], kind: Any, original: Any) -> Any:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        _sync()
        started = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            _sync()
            name, tokens = kind(*args)
            log.append((name, tokens, time.perf_counter() - started))
    return wrapper


def _step_kind(planned: Any, result: Any) -> tuple[str, int]:
    rows = [row for _, row in planned]
    prefill = sum(len(r.tokens) for r in rows if len(r.tokens) > 1)
    decodes = sum(1 for r in rows if len(r.tokens) == 1)
    kind = "decode" if not prefill else ("prefill" if not decodes else "mixed")
    return f"step {kind} rows={len(rows)}", prefill + decodes


def instrument(log: list[tuple[str, int, float]]) -> None:
    runner.Engine._run = _timed(log, _step_kind, runner.Engine._run)
    seq_pages.CachedPages.commit_prompt = _timed(
        log, lambda pages, tokens: ("commit_prompt", len(tokens)),
        seq_pages.CachedPages.commit_prompt)
    seq_pages.CachedPages.close = _timed(
        log, lambda pages, tokens, **kw: ("close", len(tokens)), seq_pages.CachedPages.close)


def summarize(log: list[tuple[str, int, float]]) -> list[dict[str, Any]]:
    groups: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for name, tokens, seconds in log:
        groups[name].append((tokens, seconds))
    out = []
    for name, items in sorted(groups.items(), key=lambda kv: -sum(s for _, s in kv[1])):
        total = sum(s for _, s in items)
        tokens = sum(t for t, _ in items)
        out.append({"what": name, "count": len(items), "total_s": round(total, 3),
                    "mean_ms": round(1000 * total / len(items), 2), "tokens": tokens,
                    "tokens_per_s": round(tokens / total, 1) if total else None})
    return out


def kernel_vs_flash(lm: Any, length: int, page_size: int) -> dict[str, Any]:
    """The paged prefill kernel over one ``length``-token prompt against sdpa, one layer."""
    from kvtier.engine import paged_triton

    config = lm.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    dtype, device = lm.model.dtype, lm.device
    pages = -(-length // page_size)
    keys = torch.randn((pages, page_size, kv_heads, dim), dtype=dtype, device=device)
    values = torch.randn_like(keys)
    query = torch.randn((length, heads, dim), dtype=dtype, device=device)
    table = torch.arange(pages, dtype=torch.int32, device=device)[None]
    rows = [type("Row", (), {"pages": list(range(pages)), "tokens": [0] * length, "start": 0,
                             "end": length})()]
    batch = paged_triton.TritonBatch(rows, [0], page_size, device)
    blocks, longest = batch.blocks(heads // kv_heads)
    q = query.transpose(0, 1)[None]
    k = keys.reshape(-1, kv_heads, dim)[:length].transpose(0, 1)[None]
    v = values.reshape(-1, kv_heads, dim)[:length].transpose(0, 1)[None]

    def paged_call() -> Any:
        return paged_triton.paged_attention(query, keys, values, table, blocks, dim ** -0.5,
                                            longest)

    def flash_call() -> Any:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    out = {}
    for name, call in (("paged_kernel", paged_call), ("sdpa_causal", flash_call)):
        call()
        _sync()
        started = time.perf_counter()
        for _ in range(10):
            call()
        _sync()
        out[f"{name}_ms"] = round(100 * (time.perf_counter() - started), 3)
    flops = 4 * heads * dim * length * length / 2
    out["paged_tflops"] = round(flops / (out["paged_kernel_ms"] / 1000) / 1e12, 1)
    out["sdpa_tflops"] = round(flops / (out["sdpa_causal_ms"] / 1000) / 1e12, 1)
    out["layers"] = config.num_hidden_layers
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b-shape")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=5000)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--host-pool", default="8GiB")
    parser.add_argument("--kernel-lengths", default="2048,5000,16384")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    vocab = lm.config.vocab_size
    result: dict[str, Any] = {"machine": machine_info(), "settings": vars(args) | {"json": None}}
    result["kernel"] = {n: kernel_vs_flash(lm, n, 64) for n in map(int, args.kernel_lengths.split(","))}
    print(json.dumps(result["kernel"], indent=1))
    log: list[tuple[str, int, float]] = []
    service = _service(lm, args.device, args.dtype, args.concurrency, args.host_pool)
    try:
        _timed_concurrent(service, _prompts(2, 64, 99, vocab), 8)
        instrument(log)
        run = _timed_concurrent(service, _prompts(args.concurrency, args.prompt_tokens, 5, vocab),
                                args.new_tokens)
    finally:
        service.close()
    result["run"], result["steps"] = run, summarize(log)
    rows = [[s["what"], s["count"], s["total_s"], s["mean_ms"], s["tokens"], s["tokens_per_s"]]
            for s in result["steps"]]
    text = format_table(["what", "count", "total s", "mean ms", "tokens", "tokens/s"], rows)
    text += f"\nrun: {run}"
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
        args.json.with_suffix(".txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
