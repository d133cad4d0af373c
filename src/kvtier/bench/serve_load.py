"""The load generator of ``kvtier bench serve``: streaming completions at a rate or a concurrency.

Owns ``send`` (one streamed ``/v1/completions`` request over the standard library's
``http.client``: time to the first text, the gaps between text chunks, the usage block with
the server's cached prompt tokens, ``prompt_tokens_details.cached_tokens``, and kvtier's per
tier), ``run_load`` (a workload at a fixed concurrency, or as Poisson
arrivals at a request rate, each request on its own thread) and ``summarize`` (percentiles,
throughput, cached share per tier). No third-party client, so it runs wherever Python does.
Threads: the caller's plus one per request in flight.
"""

from __future__ import annotations

import http.client
import json
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvtier.bench.serve_workloads import ServeRequest

TIERS = ("device", "host", "disk", "remote")


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    completion_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    error: str = ""
    #: ``usage.prompt_tokens_details.cached_tokens`` (any OpenAI-compatible server that reports it).
    cached_tokens: int = 0


def _connection(base: str, timeout: float) -> http.client.HTTPConnection:
    parts = urlsplit(base)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return cls(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)


def model_name(base: str, api_key: str = "", timeout: float = 30.0) -> str:
    """The first model the server lists at ``/v1/models``."""
    conn = _connection(base, timeout)
    try:
        conn.request("GET", "/v1/models", headers=_headers(api_key))
        body = json.loads(conn.getresponse().read())
    finally:
        conn.close()
    return body["data"][0]["id"]


def _headers(api_key: str) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def send(base: str, model: str, request: ServeRequest, *, api_key: str = "",
         timeout: float = 600.0) -> RequestResult:
    """One streamed completion, greedy, ignoring EOS (every request generates its tokens)."""
    body = {"model": model, "prompt": list(request.prompt), "max_tokens": request.max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}, "user": request.tenant or None}
    result = RequestResult(False, len(request.prompt))
    conn = _connection(base, timeout)
    started = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), _headers(api_key))
        response = conn.getresponse()
        if response.status != 200:
            result.error = f"HTTP {response.status}: {response.read()[:200]!r}"
            return result
        _read_stream(response, result, started)
        result.ok = not result.error
    except (OSError, http.client.HTTPException, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
        result.latency_s = time.perf_counter() - started
    return result


def _read_stream(response: Any, result: RequestResult, started: float) -> None:
    last = None
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = str(chunk["error"].get("message"))
        usage = chunk.get("usage")
        if usage:
            result.completion_tokens = int(usage.get("completion_tokens", 0))
            details = usage.get("prompt_tokens_details") or {}
            result.cached_tokens = int(details.get("cached_tokens") or 0)
            by_tier = (usage.get("kvtier") or {}).get("cached_tokens_by_tier") or {}
            result.cached_by_tier = {t: int(by_tier.get(t, 0)) for t in TIERS}
        # A token's chunk: the server sends one per generated token, its text possibly empty
        # (incomplete UTF-8, a held-back stop string); the closing chunk has a finish_reason.
        if any(choice.get("finish_reason") is None for choice in chunk.get("choices") or ()):
            now = time.perf_counter()
            if last is None:
                result.ttft_s = now - started
            else:
                result.itl_s.append(now - last)
            last = now


def run_load(base: str, model: str, requests: list[ServeRequest], *,
             concurrency: int | None = None, rate: float | None = None, seed: int = 0,
             api_key: str = "") -> tuple[list[RequestResult], float]:
    """Send every request; at most ``concurrency`` in flight, or Poisson arrivals at ``rate``
    per second (neither: all at once). Returns results in request order and the wall time."""
    started = time.perf_counter()
    if rate is None:
        workers = concurrency or len(requests)
        with ThreadPoolExecutor(workers, thread_name_prefix="bench-serve") as pool:
            results = list(pool.map(lambda r: send(base, model, r, api_key=api_key), requests))
        return results, time.perf_counter() - started
    rng = random.Random(f"arrivals-{seed}")
    results: list[RequestResult | None] = [None] * len(requests)

    def one(i: int) -> None:
        results[i] = send(base, model, requests[i], api_key=api_key)
    threads, due = [], 0.0
    for i in range(len(requests)):
        time.sleep(max(0.0, started + due - time.perf_counter()))
        thread = threading.Thread(target=one, args=(i,), daemon=True)
        thread.start()
        threads.append(thread)
        due += rng.expovariate(rate)
    for thread in threads:
        thread.join()
    return [r for r in results if r is not None], time.perf_counter() - started


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarize(results: list[RequestResult], wall_s: float) -> dict[str, Any]:
    """Throughput, TTFT / ITL / latency percentiles (ms), cached share of prompt tokens (all of
    it as the server reports it, ``cached_tokens_share``, and kvtier's per tier)."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    itl = [gap * 1e3 for r in ok for gap in r.itl_s]
    prompt = sum(r.prompt_tokens for r in ok)
    generated = sum(r.completion_tokens for r in ok)
    cached = {t: sum(r.cached_by_tier.get(t, 0) for r in ok) for t in TIERS}
    return {
        "requests": len(results), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "wall_s": round(wall_s, 3), "prompt_tokens": prompt, "generated_tokens": generated,
        "requests_per_s": round(len(ok) / wall_s, 3) if wall_s else None,
        "output_tokens_per_s": round(generated / wall_s, 2) if wall_s else None,
        "total_tokens_per_s": round((prompt + generated) / wall_s, 2) if wall_s else None,
        "ttft_ms_p50": _pct(ttft, 0.5), "ttft_ms_p99": _pct(ttft, 0.99),
        "ttft_ms_mean": statistics.fmean(ttft) if ttft else None,
        "itl_ms_p50": _pct(itl, 0.5), "itl_ms_p99": _pct(itl, 0.99),
        "latency_ms_p50": _pct([r.latency_s * 1e3 for r in ok], 0.5),
        "cached_share": {t: round(cached[t] / prompt, 4) if prompt else 0.0 for t in TIERS},
        "cached_tokens_share": round(sum(r.cached_tokens for r in ok) / prompt, 4) if prompt
        else 0.0,
    }
