"""``kvtier bench ttft``: time to first token per cache tier and prefix length, against recompute.

Loads the model once, runs ``kvtier.bench.ttft`` (every hit paired with a recompute of the same
prompt length with kvtier off), prints a table, checks the goals, and writes JSON (with machine
info), a text table beside it and a PNG plot. Also reports the miss-path overhead: TTFT with
kvtier on and 0% hits against ``--no-cache``. Needs no web framework or Redis client unless a
``redis`` tier is asked for. Main thread.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvtier.config import add_config_flags, config_from_args

DEFAULT_TIERS = "recompute,device,host,disk,disk-load"
#: (tier, prefix tokens, the most TTFT may be as a share of recompute), from the goals of the issue.
RATIO_GOALS = (("host", 32768, 1 / 12), ("host", 4096, 1 / 8))
MISS_OVERHEAD_GOAL = 0.02


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("ttft", help="Time to first token per tier and prefix length.")
    parser.add_argument("--prefix-tokens", default="1024,4096,16384,32768",
                        help="Comma-separated cached prefix lengths.")
    parser.add_argument("--tiers", default=DEFAULT_TIERS,
                        help="Comma-separated: recompute, device, host, disk, disk-load "
                             "(disk without the hybrid split), redis, redis-load.")
    parser.add_argument("--repeats", type=int, default=3, help="Prefixes per length (median).")
    parser.add_argument("--suffix-tokens", type=int, default=32,
                        help="New tokens after the cached prefix in each request.")
    parser.add_argument("--json", metavar="OUT", help="Write results as JSON (and OUT.txt).")
    parser.add_argument("--plot", metavar="PNG", help="Write the plot here.")
    parser.add_argument("--cold-disk", choices=("fadvise", "drop_caches"), default="fadvise",
                        help="How disk hits are made cold: evict the store's files from the page "
                             "cache (fadvise), or drop the whole machine's page cache (root; only "
                             "on a machine of the benchmark's own) [default: fadvise].")
    parser.add_argument("--no-progress", action="store_true", help="No progress bar.")
    add_config_flags(parser)
    parser.set_defaults(handler=run)


def _plan(args: argparse.Namespace, config: Any, scratch: Path) -> Any:
    from kvtier.bench.ttft import TIER_NAMES, TtftPlan
    from kvtier.errors import ConfigError

    tiers = tuple(t.strip() for t in args.tiers.split(",") if t.strip())
    for tier in tiers:
        if tier not in TIER_NAMES:
            raise ConfigError("--tiers", tier, ", ".join(TIER_NAMES))
    if any(t.startswith("redis") for t in tiers) and not config.store.remote_url:
        raise ConfigError("--redis", "", "a redis:// URL when a redis tier is measured")
    lengths = tuple(int(n) for n in args.prefix_tokens.split(","))
    disk_url = config.store.disk_url or f"file://{scratch}/disk"
    return TtftPlan(lengths, tiers, args.repeats, args.suffix_tokens, config.engine.seed,
                    disk_url, config.store.remote_url, args.cold_disk == "drop_caches")


def goals(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal of the issue that this run measured, with its verdict."""
    by_key = {(r["tier"], r["prefix_tokens"]): r for r in summary["rows"]}
    out: list[dict[str, Any]] = []
    for tier, length, share in RATIO_GOALS:
        row = by_key.get((tier, length))
        if row:
            out.append({"goal": f"{tier} hit at {length} tokens <= 1/{round(1 / share)} of recompute",
                        "tier": tier, "prefix_tokens": length, "speedup_at_least": 1 / share,
                        "measured_ratio": row["ratio_to_recompute"],
                        "met": row["ratio_to_recompute"] <= share})
    for miss in summary["miss_path"]:
        out.append({"goal": f"miss-path overhead at {miss['prefix_tokens']} tokens <= 2%",
                    "prefix_tokens": miss["prefix_tokens"], "measured_overhead": miss["overhead"],
                    "met": miss["overhead"] <= MISS_OVERHEAD_GOAL})
    for (tier, length), row in by_key.items():
        load_only = by_key.get(("disk-load", length))
        if tier == "disk" and load_only:
            best_other = min(load_only["ttft_s"], row["recompute_s"])
            out.append({"goal": f"disk hybrid at {length} tokens beats pure load and recompute",
                        "prefix_tokens": length, "hybrid_s": row["ttft_s"],
                        "load_only_s": load_only["ttft_s"], "recompute_s": row["recompute_s"],
                        "met": row["ttft_s"] < best_other})
    return out


def table(summary: dict[str, Any]) -> str:
    from kvtier.machine import format_table

    rows = [[r["tier"], r["prefix_tokens"], r["ttft_s"] * 1e3, r["recompute_s"] * 1e3,
             r["ratio_to_recompute"], r["speedup"], r["cached_tokens"] if r["cached_tokens"]
             is not None else "-", r["recomputed_hit_tokens"] if r["recomputed_hit_tokens"]
             is not None else "-"] for r in summary["rows"]]
    main = format_table(["tier", "prefix", "ttft_ms", "recompute_ms", "ratio", "speedup",
                         "cached", "recomputed_hit"], rows)
    miss = format_table(["prefix", "kvtier_on_ms", "no_cache_ms", "overhead_%"],
                        [[m["prefix_tokens"], m["kvtier_on_s"] * 1e3, m["no_cache_s"] * 1e3,
                          m["overhead"] * 100] for m in summary["miss_path"]])
    verdicts = "\n".join(f"  [{'met' if g['met'] else 'MISSED'}] {g['goal']}"
                         for g in summary.get("goals", []))
    return f"{main}\n\nmiss path (0% hits, kvtier on vs --no-cache):\n{miss}\n\ngoals:\n{verdicts}"


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="ttft", unit="run")


def run(args: argparse.Namespace) -> int:
    from kvtier.bench.ttft import TtftRun, summarize
    from kvtier.engine.hf import load_model

    config = config_from_args(args)
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-ttft-"))
    try:
        plan = _plan(args, config, scratch)
        lm = load_model(config.engine.model, device=config.engine.device,
                        dtype=config.engine.dtype, seed=config.engine.seed,
                        attention=config.engine.attention,
                        deterministic=config.engine.deterministic)
        bench = TtftRun(config, lm, plan)
        bar = _progress(bench.steps(), not args.no_progress)
        if bar is not None:
            bench.progress = lambda label: (bar.set_postfix_str(label), bar.update(1))
        interrupted = False
        try:
            bench.run()
        except KeyboardInterrupt:  # keep what was measured (SIGINT, e.g. from `timeout -s INT`)
            interrupted = True
        if bar is not None:
            bar.close()
        summary = summarize(bench)
        summary["interrupted"] = interrupted
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary["goals"] = goals(summary)
    summary["setup"] = {"model": lm.name, "device": str(lm.device), "dtype": lm.dtype_name,
                        "page_size": config.cache.page_size, "repeats": plan.repeats,
                        "suffix_tokens": plan.suffix_tokens, "tiers": list(plan.tiers),
                        "prefix_tokens": list(plan.prefix_tokens),
                        "host_pool_bytes": config.host.pool_bytes,
                        "cold_disk": args.cold_disk,
                        "prefetch_policy": config.controller.prefetch_policy,
                        "fingerprint": lm.fingerprint}
    text = table(summary)
    print(text)
    _write(args, summary, text)
    return 0


def _write(args: argparse.Namespace, summary: dict[str, Any], text: str) -> None:
    from kvtier.machine import write_report

    if args.json:
        path = write_report(args.json, "ttft", summary)
        path.with_suffix(".txt").write_text(text + "\n")
    if args.plot:
        import json

        from kvtier.bench.ttft_plot import plot_ttft

        data = json.loads(Path(args.json).read_text()) if args.json else summary
        plot_ttft(data, args.plot)
