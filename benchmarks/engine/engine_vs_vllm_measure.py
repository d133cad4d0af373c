"""``engine_vs_vllm.py``'s measurement helpers that kvtier's and vLLM's cases share: a hit's
suffix, the generated tokens of a throughput or inter-token-latency prompt, the seeded prompts of
those runs, the inter-token latency from two timed batches, and ``attempt`` (a failed
measurement is recorded and its case goes on). The child process's main thread runs them (a
case in its ``--case`` process).

Imports ``vllm_gpu_case`` from ``benchmarks/vllm``: ``engine_vs_vllm.py`` puts that folder on
``sys.path``.
"""

from __future__ import annotations

import statistics
import traceback
from typing import Any

from vllm_gpu_case import THROUGHPUT_NEW, log, prompt

SUFFIX_TOKENS = 32                       # a hit's new tokens (kvtier bench ttft's default)
NEW_TOKENS = THROUGHPUT_NEW              # 128 generated tokens a throughput or ITL prompt
ITL_BATCHES = (1, 16)


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


def itl_from(run: Any, batch: int, length: int, repeats: int, variant: int = 0
             ) -> dict[str, Any]:
    """``run(prompts, new)`` returns wall seconds; the decode step time at ``batch``. Each
    ``variant`` (a setting measured on the same engine) gets prompts of its own, so none of
    its prefills is a cache hit left by another variant."""
    short, long_ = [], []
    for r in range(repeats):
        tag = 2 * r + 100 * variant
        short.append(run(itl_prompts(batch, length, tag), 1))
        long_.append(run(itl_prompts(batch, length, tag + 1), NEW_TOKENS + 1))
    ms = (statistics.median(long_) - statistics.median(short)) / NEW_TOKENS * 1e3
    return {"batch": batch, "prompt_tokens": length, "itl_ms": round(ms, 3),
            "wall_1_new_s": [round(x, 4) for x in short],
            f"wall_{NEW_TOKENS + 1}_new_s": [round(x, 4) for x in long_]}
