"""Where a hit's time to first token goes: the engine's phases, timed one by one on a real model.

For each prefix length this runs, through ``PrefixCache`` directly (no scheduler, no HTTP):
recompute (kvtier off), a device hit, a host hit loaded under the forward (``overlap``) and one
waited for whole, each with a fresh 32-token suffix, median of ``--repeats``; the hits run the
captured suffix forward (``kvtier.engine.graphs``) where ``--graph-tokens`` allows, and the
device and overlapped host hits once more on transformers' eager forward. For every hit it
reports the host time spent in match, load, append and the forward's launches, and the rest
(the device finishing the work the host queued). It also times the suffix forward alone on a
plain transformers cache: launch time (until ``forward`` returns) and the device total, which
is the floor any hit pays. Optionally writes a torch profiler table of one host hit.

``PYTHONPATH=src python benchmarks/ttft/ttft_breakdown.py --model llama3-8b-shape --device cuda
--prefix-tokens 4096,32768 --out results/ttft_breakdown.json``. Main thread.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from kvtier.config import build_config
from kvtier.engine import kv_pages
from kvtier.engine.graphs import SuffixGraphs
from kvtier.engine.hf import load_model
from kvtier.engine.prefix import PrefixCache
from kvtier.engine.request import PrefillReport
from kvtier.machine import format_table, write_report
from kvtier.transfer.kernels import KernelConfig

PHASES = ("match", "load", "append", "forward_launch")


def _sync(lm: Any) -> None:
    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)


class PhaseClock:
    """Wraps the prefill's calls and adds up the host seconds each takes."""

    def __init__(self, cache: PrefixCache) -> None:
        self.spent = dict.fromkeys(PHASES, 0.0)
        self.timeline: list[tuple[str, float, float]] = []  # (phase, start, seconds)
        self.origin = time.perf_counter()
        tiered, lm = cache.tiered, cache.lm
        self._undo = [(tiered, "match", tiered.match), (tiered, "load", tiered.load),
                      (kv_pages, "append_pages", kv_pages.append_pages),
                      (lm, "forward", lm.forward)]
        tiered.match = self._wrap("match", tiered.match)
        tiered.load = self._wrap("load", tiered.load)
        kv_pages.append_pages = self._wrap("append", kv_pages.append_pages)
        lm.forward = self._wrap("forward_launch", lm.forward)
        if cache.graphs is not None:  # a captured suffix forward launches in its place
            self._undo.append((cache.graphs, "forward", cache.graphs.forward))
            cache.graphs.forward = self._wrap("forward_launch", cache.graphs.forward)

    def _wrap(self, phase: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - start
                self.spent[phase] += took
                self.timeline.append((phase, round(start - self.origin, 5), round(took, 5)))
        return timed

    def close(self) -> None:
        for owner, name, fn in self._undo:
            if owner is kv_pages:
                setattr(owner, name, fn)
            else:  # the wrapper shadowed a method on the instance
                owner.__dict__.pop(name, None)


def hit_once(cache: PrefixCache, prompt: list[int]) -> dict[str, float]:
    """One prefill through the cache to its first token, phase by phase (seconds)."""
    _sync(cache.lm)
    clock = PhaseClock(cache)
    report = PrefillReport(len(prompt))
    start = time.perf_counter()
    try:
        kv, logits, state = cache.prefill(prompt, None, report)
        int(torch.argmax(logits).item())
        total = time.perf_counter() - start
    finally:
        clock.close()
    cache.commit_prompt(state, prompt, kv)
    cache.settle()
    out = {"total": total, **clock.spent, "cached": report.cached_tokens,
           "recomputed_hit": report.recomputed_hit_tokens, "timeline": clock.timeline}
    out["device_tail"] = total - sum(clock.spent[p] for p in PHASES)
    return out


def same_logits(cache: PrefixCache, prompt: list[int]) -> dict[str, float]:
    """The last logits of one prompt served as a device hit, a host hit loaded under the forward
    and one waited for: the KV bytes are the same, so the logits must be identical. Where
    captured graphs serve the hits, the eager forward's logits are added (padded GEMMs and the
    fused kernels round differently), and the whole prompt recomputed, with whether the first
    token agrees everywhere."""
    logits = {}
    hit_once(cache, prompt)
    graphs = cache.graphs
    cases = [("device", (), True, graphs), ("host overlapped", ("device",), True, graphs),
             ("host waited", ("device",), False, graphs)]
    if graphs is not None:
        cases += [("device, eager", (), True, None), ("host overlapped, eager", ("device",), True, None)]
    for name, drop, overlap, static in cases:
        cache.overlap, cache.graphs = overlap, static
        if drop:
            cache.drop_tiers(drop)
        kv, out, state = cache.prefill(prompt, None, PrefillReport(len(prompt)))
        logits[name] = out.clone()
        cache.commit_prompt(state, prompt, kv)
        cache.settle()
    cache.overlap, cache.graphs = True, graphs
    with torch.inference_mode():  # the whole prompt recomputed (sdpa's causal kernel over it)
        logits["recompute"] = cache.lm.forward(torch.tensor(prompt, device=cache.lm.device),
                                               cache.lm.new_cache()).clone()
    gaps = {name: float((value - logits["device"]).abs().max()) for name, value in logits.items()}
    gaps["eager device vs recompute"] = (
        float((logits["device, eager"] - logits["recompute"]).abs().max())
        if "device, eager" in logits else None)
    gaps["largest |logit|"] = float(logits["recompute"].abs().max())
    gaps["same first token"] = float(len({int(v.argmax()) for v in logits.values()}) == 1)
    return gaps


def hits_with_graphs(cache: PrefixCache, graphs: Any, label: str, prompt: Any,
                     samples: dict[str, list[dict[str, float]]]) -> None:
    """A device hit and an overlapped host hit (``prompt()`` gives each its prompt) served by
    ``graphs`` instead of the cache's own (None: transformers' eager forward)."""
    own, cache.graphs = cache.graphs, graphs
    try:
        samples.setdefault(f"device, {label}", []).append(hit_once(cache, prompt()))
        cache.drop_tiers(("device",))
        samples.setdefault(f"host overlapped, {label}", []).append(hit_once(cache, prompt()))
    finally:
        cache.graphs = own


def recompute_once(lm: Any, prompt: list[int]) -> float:
    _sync(lm)
    start = time.perf_counter()
    cache = lm.new_cache()
    logits = lm.forward(torch.tensor(prompt, device=lm.device), cache)
    int(torch.argmax(logits).item())
    return time.perf_counter() - start


def suffix_alone(lm: Any, prefix: list[int], suffix: list[int], repeats: int) -> dict[str, float]:
    """The suffix forward on a plain transformers cache holding ``prefix``: launch and total."""
    from transformers import DynamicCache

    cache = DynamicCache(config=lm.config)
    lm.forward(torch.tensor(prefix, device=lm.device), cache)
    launches, totals = [], []
    tokens = torch.tensor(suffix, device=lm.device)
    for _ in range(repeats + 1):
        _sync(lm)
        start = time.perf_counter()
        logits = lm.forward(tokens, cache)
        launched = time.perf_counter() - start
        int(torch.argmax(logits).item())
        totals.append(time.perf_counter() - start)
        launches.append(launched)
        cache.crop(-len(suffix))
    return {"launch": statistics.median(launches[1:]), "total": statistics.median(totals[1:])}


def swap_copy_path(cache: PrefixCache, path: str) -> None:
    """Serve host -> device copies through the kernels or the copy engines from now on."""
    from kvtier.transfer import CopyEngine

    ctx = cache.tiered.ctx
    cache.settle()
    ctx.copy = CopyEngine(ctx.device_pool, ctx.host_pool, path=path)


def disk_cases(cache: PrefixCache, prefix: list[int], tokens: Any, args: argparse.Namespace,
               samples: dict[str, list[dict[str, float]]]) -> None:
    """A hit only the (cold) disk holds: loaded whole, then split with recompute as planned."""
    from kvtier.bench.coldcache import drop_page_cache

    for split in ("load", "plan"):
        for _ in range(args.repeats):
            cache.drop_tiers(("device", "host"))
            drop_page_cache(args.disk, whole_machine=True)
            cache.split = split
            try:
                one = hit_once(cache, prefix + tokens(args.suffix))
            finally:
                cache.split = "plan"
            samples.setdefault(f"disk cold, split={split}", []).append(one)
    samples["disk cold, split=load"][-1]["rates"] = cache.stats().get("rates")


def profile_host_hit(cache: PrefixCache, prompt: list[int], path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    cache.drop_tiers(("device",))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        hit_once(cache, prompt)
    table = prof.key_averages()
    path.write_text(table.table(sort_by="self_cuda_time_total", row_limit=25) + "\n\n"
                    + table.table(sort_by="cpu_time_total", row_limit=25) + "\n")
    prof.export_chrome_trace(str(path.with_suffix(".trace.json")))


def run(args: argparse.Namespace) -> dict[str, Any]:
    flags = {"engine.model": args.model, "engine.device": args.device, "engine.dtype": args.dtype,
             "cache.page_size": args.page_size, "host.pool_bytes": args.host_pool_bytes,
             "host.pinned_budget_bytes": args.pinned_budget_bytes, "store.disk_url": args.disk,
             "controller.prefetch_policy": "wait_complete", "engine.graph_tokens": args.graph_tokens}
    config = build_config(env={}, flags=flags)
    lm = load_model(args.model, device=args.device, dtype=args.dtype, attention=args.attention)
    cache = PrefixCache.build(config, lm)
    rng = random.Random(0)
    vocab = min(int(lm.config.vocab_size), 32000)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(16, vocab) for _ in range(n)]

    unfused = None
    if cache.graphs is not None and args.unfused:
        unfused = SuffixGraphs(lm, args.graph_tokens, fuse=False)
        unfused.warm()
    rows, raw = [], {}
    try:
        warm = tokens(512)
        for _ in range(2):
            hit_once(cache, warm + tokens(args.suffix))
            cache.drop_tiers(("device",))
            hit_once(cache, warm + tokens(args.suffix))
        for length in args.prefix_tokens:
            prefix = tokens(length)
            samples: dict[str, list[dict[str, float]]] = {}
            for _ in range(args.repeats):
                prompt = prefix + tokens(args.suffix)
                samples.setdefault("recompute", []).append({"total": recompute_once(lm, prompt)})
                hit_once(cache, prompt)  # the miss path fills the tiers
                samples.setdefault("device", []).append(hit_once(cache, prefix + tokens(args.suffix)))
                if getattr(lm.model.config, "_attn_implementation", "") == "kvtier":
                    # eager: a captured graph keeps the attention it was captured with
                    lm.model.set_attn_implementation("sdpa")
                    graphs, cache.graphs = cache.graphs, None
                    cache.drop_tiers(("device",))
                    samples.setdefault("host overlapped, sdpa attention, eager", []).append(
                        hit_once(cache, prefix + tokens(args.suffix)))
                    lm.model.set_attn_implementation("kvtier")
                    cache.graphs = graphs
                if cache.tiered.ctx.copy.asynchronous:
                    swap_copy_path(cache, "copy_engine")
                    cache.drop_tiers(("device",))
                    samples.setdefault("host overlapped, copy engines", []).append(
                        hit_once(cache, prefix + tokens(args.suffix)))
                    swap_copy_path(cache, "kernel")
                    for programs in args.load_programs:  # the copy held to part of the chip
                        cache.tiered.ctx.copy._configs["load"] = KernelConfig(max_programs=programs)
                        cache.drop_tiers(("device",))
                        samples.setdefault(f"host overlapped, load on {programs} programs",
                                           []).append(hit_once(cache, prefix + tokens(args.suffix)))
                    cache.tiered.ctx.copy._configs["load"] = None
                for overlap in (True, False):
                    cache.overlap = overlap
                    cache.drop_tiers(("device",))
                    key = "host overlapped" if overlap else "host waited"
                    samples.setdefault(key, []).append(hit_once(cache, prefix + tokens(args.suffix)))
                cache.overlap = True
                new_prompt = lambda p=prefix: p + tokens(args.suffix)  # noqa: E731
                if unfused is not None:  # graphs of transformers' own element-wise chains
                    hits_with_graphs(cache, unfused, "graphs unfused", new_prompt, samples)
                if cache.graphs is not None:  # the same hits on transformers' eager forward
                    hits_with_graphs(cache, None, "eager", new_prompt, samples)
            if args.disk:
                disk_cases(cache, prefix, tokens, args, samples)
            alone = suffix_alone(lm, prefix, tokens(args.suffix), args.repeats)
            samples["suffix forward alone"] = [{"total": alone["total"],
                                                "forward_launch": alone["launch"]}]
            raw[length] = samples
            base = statistics.median(s["total"] for s in samples["recompute"])
            for name, runs in samples.items():
                med = {k: statistics.median(r.get(k, 0.0) for r in runs)
                       for k in ("total", *PHASES, "device_tail")}
                rows.append({"prefix_tokens": length, "case": name, **med,
                             "ratio_to_recompute": med["total"] / base})
            print(f"{length} done", flush=True)
        consistency = same_logits(cache, tokens(args.prefix_tokens[-1] + args.suffix))
        print(f"max |logits - device hit's|: {consistency}", flush=True)
        if args.profile:
            prompt = tokens(args.prefix_tokens[-1])
            hit_once(cache, prompt)
            profile_host_hit(cache, prompt + tokens(args.suffix), Path(args.profile))
    finally:
        graph_stats = None if cache.graphs is None else cache.graphs.stats()
        cache.close()
    setup = flags | {"suffix_tokens": args.suffix, "repeats": args.repeats,
                     "attention": args.attention,
                     "graphs": graph_stats}
    return {"rows": rows, "raw": raw, "logit_gaps": consistency, "setup": setup}


def table(summary: dict[str, Any]) -> str:
    ms = lambda v: f"{v * 1e3:.1f}"  # noqa: E731
    return format_table(
        ["prefix", "case", "ttft_ms", "ratio", "match", "load", "append", "fwd_launch", "tail"],
        [[r["prefix_tokens"], r["case"], ms(r["total"]), f"{r['ratio_to_recompute']:.3f}",
          ms(r["match"]), ms(r["load"]), ms(r["append"]), ms(r["forward_launch"]),
          ms(r["device_tail"])] for r in summary["rows"]])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b-shape")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--prefix-tokens", type=lambda s: [int(x) for x in s.split(",")],
                        default=[4096, 32768])
    parser.add_argument("--suffix", type=int, default=32)
    parser.add_argument("--attention", default="kvtier", choices=("kvtier", "sdpa"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--unfused", action="store_true",
                        help="also time hits on graphs without the fused RMSNorm/rotary kernels")
    parser.add_argument("--load-programs", type=lambda s: [int(x) for x in s.split(",") if x],
                        default=[16, 32], help="also time host hits with the load kernel's grid "
                        "capped at each of these")
    parser.add_argument("--graph-tokens", type=int, default=8192,
                        help="engine.graph_tokens (0: transformers' eager forward only)")
    parser.add_argument("--host-pool-bytes", default="16GiB")
    parser.add_argument("--pinned-budget-bytes", default="24GiB")
    parser.add_argument("--disk", default="", help="a file:// URL: add cold-disk hits")
    parser.add_argument("--profile", default="", help="write a torch profiler table here")
    parser.add_argument("--out", default="", help="JSON path (a .txt table beside it)")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    summary = run(args)
    text = table(summary)
    print(text)
    if args.out:
        path = write_report(args.out, "ttft_breakdown", summary)
        path.with_suffix(".txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
