"""A long host hit arriving at a loaded engine: its TTFT, and what it costs the decodes around it.

One ``EngineService`` (the server's engine) on the model given. A ``--hit-tokens`` prompt is run
once and its device pages dropped, so that it comes back as a host hit. First the hit alone on
the idle engine (TTFT, median of ``--repeats``, the device tier dropped before each); then
``--decoders`` sequences are started (``--decoder-prompt`` tokens each, long generations) and,
once every one of them is decoding, the same hit is sent: its TTFT, and the decoders'
inter-token gaps in the second before the hit against the gaps while it loads (from its
submission to its first token). Goals (the batching issue): loaded TTFT <= 2x idle, decode
slowdown <= 20 %. Prints a table and writes ``--json`` with machine info. Usage (the H200)::

    PYTHONPATH=src python benchmarks/serve/hit_under_load.py --json hit_under_load_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from batching_gpu import _prompts
from kvtier.config import build_config
from kvtier.engine.hf import load_model
from kvtier.engine.request import GenerationRequest, TokenEvent
from kvtier.engine.service import EngineService
from kvtier.machine import format_table, machine_info


class Decoder:
    """One running sequence, its token times recorded by a thread of its own."""

    def __init__(self, service: EngineService, prompt: list[int], new: int) -> None:
        self.times: list[float] = []
        self.handle = service.submit(GenerationRequest(tuple(prompt), new))
        self.thread = threading.Thread(target=self._collect, daemon=True)
        self.thread.start()

    def _collect(self) -> None:
        for event in self.handle.events(1800):
            if isinstance(event, TokenEvent):
                self.times.append(time.perf_counter())

    def gaps(self, start: float, end: float) -> list[float]:
        """Gaps between this sequence's tokens that arrived within ``[start, end]``."""
        inside = [t for t in self.times if start <= t <= end]
        return [b - a for a, b in zip(inside, inside[1:], strict=False)]


def _drop_device(service: EngineService) -> None:
    service.scheduler.call_soon(
        lambda: service.prefix_cache.drop_tiers(("device",))).result(600)


def _ttft(service: EngineService, prompt: list[int]) -> tuple[float, Any]:
    started = time.perf_counter()
    handle = service.submit(GenerationRequest(tuple(prompt), 2))
    first = None
    finish = None
    for event in handle.events(1800):
        if isinstance(event, TokenEvent):
            first = first or time.perf_counter()
        else:
            finish = event
    return (first or time.perf_counter()) - started, finish


def run(args: argparse.Namespace) -> dict[str, Any]:
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    vocab = lm.config.vocab_size
    flags = {"engine.device": args.device, "engine.dtype": args.dtype,
             "engine.max_running": str(args.decoders + 1), "host.pool_bytes": args.host_pool,
             "host.pinned_budget_bytes": args.pinned_budget}
    service = EngineService.build(build_config(env={}, flags=flags), lm=lm)
    hit = _prompts(1, args.hit_tokens, 11, vocab)[0]
    out: dict[str, Any] = {}
    try:
        _ttft(service, _prompts(1, 64, 99, vocab)[0])                 # warm-up
        _ttft(service, hit)                                           # cache the hit's pages
        idle = []
        for i in range(args.repeats):
            _drop_device(service)
            seconds, finish = _ttft(service, hit + [5 + i])
            idle.append(seconds)
        out["idle"] = {"ttft_ms": round(1000 * statistics.median(idle), 1),
                       "samples_ms": [round(1000 * s, 1) for s in idle],
                       "cached_by_tier": finish.prefill.cached_by_tier}
        _drop_device(service)
        decoders = [Decoder(service, p, args.decoder_new)
                    for p in _prompts(args.decoders, args.decoder_prompt, 300, vocab)]
        while min(len(d.times) for d in decoders) < 20:
            time.sleep(0.05)
        time.sleep(1.0)
        sent = time.perf_counter()
        seconds, finish = _ttft(service, hit + [99])
        first = sent + seconds
        before = [g for d in decoders for g in d.gaps(sent - 1.0, sent)]
        during = [g for d in decoders for g in d.gaps(sent, first)]
        for d in decoders:
            d.handle.cancel()
        out["loaded"] = {"ttft_ms": round(1000 * seconds, 1),
                         "cached_by_tier": finish.prefill.cached_by_tier,
                         "decode_gap_before_ms": round(1000 * statistics.median(before), 2),
                         "decode_gap_during_ms": round(1000 * statistics.median(during), 2)
                         if during else None,
                         "decode_gap_during_max_ms": round(1000 * max(during), 2)
                         if during else None,
                         "gaps_during": len(during)}
        for d in decoders:
            d.thread.join(timeout=60)
    finally:
        service.close()
    loaded = out["loaded"]
    out["ttft_loaded_over_idle"] = round(loaded["ttft_ms"] / out["idle"]["ttft_ms"], 2)
    if loaded["decode_gap_during_ms"] is not None:
        out["decode_slowdown"] = round(
            loaded["decode_gap_during_ms"] / loaded["decode_gap_before_ms"] - 1, 3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b-shape")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--hit-tokens", type=int, default=32768)
    parser.add_argument("--decoders", type=int, default=15)
    parser.add_argument("--decoder-prompt", type=int, default=2000)
    parser.add_argument("--decoder-new", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--host-pool", default="16GiB")
    parser.add_argument("--pinned-budget", default="24GiB")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = {"machine": machine_info(), "settings": vars(args) | {"json": None}, **run(args)}
    loaded, idle = result["loaded"], result["idle"]
    rows = [["idle", idle["ttft_ms"], "", "", idle["cached_by_tier"]],
            ["beside decodes", loaded["ttft_ms"], loaded["decode_gap_before_ms"],
             loaded["decode_gap_during_ms"], loaded["cached_by_tier"]]]
    text = format_table(["hit", "TTFT ms", "decode gap before ms", "decode gap during ms",
                         "cached by tier"], rows)
    text += (f"\nTTFT loaded / idle: {result['ttft_loaded_over_idle']}x (goal <= 2x); "
             f"decode slowdown while it loads: {result.get('decode_slowdown')} (goal <= 0.2)")
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
        args.json.with_suffix(".txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
