"""Does a hit give the server's no-cache answer? Greedy tokens through the engine the server runs.

``benchmarks/engine/parity.py`` checks the per-sequence path (``PrefixCache``) kernel by kernel; this
script checks what a user of ``kvtier serve`` sees: the batched engine (``EngineService``, the
paged attention, the captured suffix forwards of a lone hit) with the cache on, against the same
engine with ``cache.enabled`` false (``--no-cache``). For each architecture (the random-weight
models of ``parity.py``), dtype and page size, every prompt is first generated with the cache
off; then, with the cache on, a sibling that shares a random-length prefix is run, and the
prompt follows as a device hit, then (device tier dropped) as a host hit, each alone; finally all
prompts at once as batched hits. A cell reports the share of prompts whose greedy tokens are
identical and ``identical`` (all of them). The cache's tier drops run on the engine thread
(``Scheduler.call_soon``). Prints a table and writes ``--json`` with machine info. Usage (the
H200)::

    PYTHONPATH=src python benchmarks/serve/serve_parity.py --device cuda \\
        --dtypes bfloat16,float32 --prompts 200 --json serve_parity_h200.json

``--disk DIR --restart`` adds a ``restart`` cell: the cached server is closed (its disk writes
flushed) and a new one opened on the same directory serves each prompt as a disk hit, split
between recompute and load as the planner chooses (``--split plan``; the default ``auto``
splits only in the deterministic mode, where the split is exact) once a few
unrelated prompts taught it the prefill rate; the cell's ``cached_tokens_by_tier`` says how
many prompts were split (``splits``) and how many hit tokens their heads recomputed.
``--restart-only`` keeps only that cell (the cached server just stores each prompt).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))   # parity (another folder)

import torch

from kvtier.config import build_config
from kvtier.engine import paged
from kvtier.engine.hf import load_model
from kvtier.engine.request import GenerationRequest
from kvtier.engine.service import EngineService
from kvtier.machine import format_table, machine_info
from parity import ARCHS, build_lm, prompts


def _service(lm: Any, args: argparse.Namespace, dtype: str, mode: str, page_size: int,
             cache: bool, running: int) -> EngineService:
    flags = {"engine.device": args.device, "engine.dtype": dtype, "cache.page_size": page_size,
             "engine.deterministic": str(mode == "deterministic").lower(),
             "cache.enabled": str(cache).lower(), "engine.max_running": str(running),
             "host.pool_bytes": "512MiB" if cache else "0",
             "store.disk_url": f"file://{args.disk}" if cache and args.disk else "",
             "server.max_concurrent_requests": str(max(64, 2 * running))}
    flags.update(dict(item.split("=", 1) for item in args.set))
    return EngineService.build(build_config(env={}, flags=flags), lm=lm,
                               split=(None if args.split == "auto" else args.split)
                               if cache else "plan")


class FirstLogits:
    """Records each request's first-token logits as the engine's forward returns them (a
    wrapper around ``Engine._forward`` on the engine thread), by request id."""

    def __init__(self, service: EngineService) -> None:
        self.by_id: dict[str, torch.Tensor] = {}
        engine = service.engine
        forward = engine._forward

        def recording(planned: Any) -> torch.Tensor:
            logits = forward(planned)
            for i, (seq, row) in enumerate(planned):
                if seq.generated == 0 and row.end == len(seq.tokens):
                    self.by_id[seq.request.request_id] = logits[i].float().cpu()
            return logits
        engine._forward = recording


Run = tuple[list[int], torch.Tensor]


def _run(service: EngineService, recorder: FirstLogits, batch: list[list[int]], new: int,
         served: dict[str, int] | None = None) -> list[Run]:
    """Greedy tokens and first-token logits of each prompt; ``served`` adds up the cached
    tokens by tier (and, as ``split_head``, the hit tokens recomputed by a split, and as
    ``splits`` how many prompts were split)."""
    handles = [service.submit(GenerationRequest(tuple(p), new)) for p in batch]
    results = [h.result(timeout=1800) for h in handles]
    for _, finish in results:
        if served is None:
            continue
        for tier, tokens in finish.prefill.cached_by_tier.items():
            served[tier] = served.get(tier, 0) + tokens
        head = finish.prefill.recomputed_hit_tokens
        served["split_head"] = served.get("split_head", 0) + head
        split = 0 < head < finish.prefill.matched_tokens
        served["splits"] = served.get("splits", 0) + int(split)
        served.setdefault("split_each", []).append(int(split))
    return [(tokens, recorder.by_id.pop(h.request.request_id))
            for h, (tokens, _) in zip(handles, results, strict=True)]


def _drop(service: EngineService, tiers: tuple[str, ...]) -> None:
    service.scheduler.call_soon(lambda: service.prefix_cache.drop_tiers(tiers)).result(600)


def run_cell(args: argparse.Namespace, arch: str, dtype: str, mode: str,
             page_size: int) -> list[dict[str, Any]]:
    started = time.perf_counter()
    if arch not in ARCHS:                    # a preset (kvtier's tiny models, real shapes)
        lm = load_model(arch, device=args.device, dtype=dtype, seed=args.seed,
                        deterministic=mode == "deterministic")
    else:
        lm = build_lm(arch, dtype, mode, args.device, args.hidden, args.layers)
        paged.install(lm.model)              # as hf.load_model does
    pairs = prompts(args.prompts, args.prompt_tokens, args.seed)
    plain = _service(lm, args, dtype, mode, page_size, False, 1)
    plain_logits = FirstLogits(plain)
    try:
        wants = [_run(plain, plain_logits, [p], args.new_tokens)[0] for p, _ in pairs]
    finally:
        plain.close()
    live = not args.restart_only
    got: dict[str, list[Run]] = {"device": [], "host": []} if live else {}
    served: dict[str, dict[str, int]] = {"device": {}, "host": {}, "disk": {}, "batched": {}}
    if args.disk and live:
        got["disk"] = []
    if args.disk:
        shutil.rmtree(args.disk, ignore_errors=True)
    cached = _service(lm, args, dtype, mode, page_size, True, max(1, len(pairs)))
    logits = FirstLogits(cached)
    try:
        for prompt, sibling in pairs:
            _drop(cached, ("device", "host"))
            _run(cached, logits, [sibling], 1)
            if not live:    # only stored, for the restart cell: the prompt's tail pages too
                _run(cached, logits, [prompt], 1)
                continue
            got["device"].append(_run(cached, logits, [prompt], args.new_tokens, served["device"])[0])
            _drop(cached, ("device",))
            got["host"].append(_run(cached, logits, [prompt], args.new_tokens, served["host"])[0])
            if args.disk:   # the store's copy, through the hybrid split the planner chooses
                _drop(cached, ("device", "host"))
                got["disk"].append(_run(cached, logits, [prompt], args.new_tokens, served["disk"])[0])
        if live:
            _drop(cached, ("device", "host"))
            _run(cached, logits, [s for _, s in pairs], 1)
            got["batched"] = _run(cached, logits, [p for p, _ in pairs], args.new_tokens,
                                  served["batched"])
    finally:
        cached.close()   # flushes the disk tier's writes, as a server's shutdown does
    if args.disk and args.restart:
        got["restart"] = _restarted(args, lm, dtype, mode, page_size, pairs,
                                    served.setdefault("restart", {}))
    del plain, cached   # their device pools go before the next cell sizes its own
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    cells = []
    for tier, rows in got.items():
        pairs_ = list(zip(rows, wants, strict=True))
        same = sum(a[0] == b[0] for a, b in pairs_)
        firsts = [next((i for i, (x, y) in enumerate(zip(a[0], b[0], strict=True)) if x != y),
                       -1) for a, b in pairs_]
        deltas = [float((a[1] - b[1]).abs().max()) for a, b in pairs_]
        split_each = served[tier].pop("split_each", [0] * len(rows))
        split_same = [a[0] == b[0] for (a, b), sp in zip(pairs_, split_each, strict=True) if sp]
        cells.append({"arch": arch, "dtype": dtype, "mode": mode, "page_size": page_size, "tier": tier,
                      "prompts": len(rows), "identical_share": round(same / len(rows), 4),
                      "identical": same == len(rows), "cached_tokens_by_tier": served[tier],
                      "split_prompts": len(split_same), "split_identical": sum(split_same),
                      "first_divergent": [f for f in firsts if f >= 0][:20],
                      "first_logits_bit_identical_share": round(
                          sum(torch.equal(a[1], b[1]) for a, b in pairs_) / len(rows), 4),
                      "max_abs_dlogit": max(deltas),
                      "mean_abs_dlogit": sum(deltas) / len(deltas),
                      "cell_wall_s": round(time.perf_counter() - started, 1)})
    return cells


def _restarted(args: argparse.Namespace, lm: Any, dtype: str, mode: str, page_size: int,
               pairs: list[tuple[list[int], list[int]]], served: dict[str, int]) -> list[Run]:
    """A new server on the same disk directory: a few unrelated prompts of three lengths
    first (misses: they teach the planner the prefill rate, as a server's first minutes do),
    then each prompt alone, a disk hit served the way the planner chooses (``--split``)."""
    service = _service(lm, args, dtype, mode, page_size, True, max(1, len(pairs)))
    recorder = FirstLogits(service)
    try:
        warm = prompts(6, args.prompt_tokens, args.seed + 1)
        for n, (prompt, _) in enumerate(warm):
            _run(service, recorder, [prompt[:args.prompt_tokens * (1 + n % 3) // 3]], 1)
        return [_run(service, recorder, [p], args.new_tokens, served)[0] for p, _ in pairs]
    finally:
        service.close()
        del service
        gc.collect()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--archs", default="llama,qwen2,mistral",
                        help="parity.py's random models, or kvtier presets (llama3-8b-shape, "
                             "qwen2.5-7b-shape: random weights, real shapes)")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--modes", default="default",
                        help="default (the library kernels: engine.deterministic false, "
                             "the CPU's default) and/or deterministic (the batch-invariant "
                             "kernels installed as hf.load_model does: CUDA's default)")
    parser.add_argument("--page-sizes", default="16,64")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--disk", default="",
                        help="a directory for a disk tier: adds disk hits (after the host cell)")
    parser.add_argument("--restart", action="store_true",
                        help="with --disk: adds a 'restart' cell, a new server on the disk "
                             "directory serving each prompt as a disk hit")
    parser.add_argument("--restart-only", action="store_true",
                        help="with --restart: only the restart cell (the cached server stores "
                             "each prompt and its sibling, no device/host/disk/batched cells)")
    parser.add_argument("--split", default="auto", choices=("auto", "plan", "load", "recompute"),
                        help="how store hits are served: auto (engine.store_hit_split: the "
                        "planner's split in the deterministic mode, loaded whole otherwise), "
                        "the planner's split always, or load them whole")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a config field for both engines, e.g. engine.graph_tokens=0")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.restart_only and not (args.disk and args.restart):
        parser.error("--restart-only needs --disk DIR and --restart")
    cells: list[dict[str, Any]] = []
    for dtype in args.dtypes.split(","):
        for arch, mode in ((a, m) for a in args.archs.split(",") for m in args.modes.split(",")):
            for page in (int(p) for p in args.page_sizes.split(",")):
                cells += run_cell(args, arch, dtype, mode, page)
                _write(args, cells)      # after every cell: a run cut short keeps what it did
    rows = [[c["arch"], c["dtype"], c["mode"], c["page_size"], c["tier"], c["prompts"],
             f"{100 * c['identical_share']:.1f} %", c["identical"],
             f"{c['split_identical']}/{c['split_prompts']}",
             f"{100 * c['first_logits_bit_identical_share']:.1f} %",
             f"{c['max_abs_dlogit']:.3g}"] for c in cells]
    text = format_table(["arch", "dtype", "mode", "page", "hit", "prompts", "identical", "all",
                         "split: identical/all",
                         "logits bit-identical", "max |dlogit|"], rows)
    print(text)
    _write(args, cells, text)
    return 0


def _write(args: argparse.Namespace, cells: list[dict[str, Any]], text: str = "") -> None:
    if args.json:
        result = {"machine": machine_info(), "settings": vars(args) | {"json": None},
                  "cells": cells}
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
        if text:
            args.json.with_suffix(".txt").write_text(text + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
