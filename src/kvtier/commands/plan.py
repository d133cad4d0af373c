"""``kvtier plan``: size the host tier (pool pages, read ring, staging) and explain the choice.

Reads the resolved config (host pool and pinned budget, prefetch share, IO workers, page size,
configured stores), a KV layout (``--layers/--kv-heads/--head-dim``, dtype from the config), and
rates given as flags or measured with ``--probe``; prints the plan as text, or JSON with
``--json``. Exits 1 when the plan does not fit the pinned budget or write-through is not
sustainable (then no size is printed as if it were correct). Main thread; torch only for probes.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from kvtier.config import KvtierConfig
from kvtier.config_flags import add_config_flags, config_from_args
from kvtier.layout import KVLayout
from kvtier.planner import Plan, PlanInputs, StoreRates, inputs_from_config, plan
from kvtier.units import parse_size

_RATE_FLAGS = ("host-bw", "disk-read-bw", "disk-write-bw", "remote-read-bw", "remote-write-bw")


def parse_rate(text: str) -> float:
    """'2GB/s' -> 2e9, '550MiB/s' -> 576716800.0, '1e9' -> 1e9 (bytes per second)."""
    body = re.sub(r"\s*/\s*s(ec)?\s*$", "", text.strip(), flags=re.IGNORECASE)
    try:
        return float(body)
    except ValueError:
        pass
    size = parse_size(body)
    if size is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate such as 2GB/s or 1.5e9")
    return float(size)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan", help="Size host pool, read ring and staging; check the pinned budget.",
        description="Plan the host tier from the KV layout, budgets and tier rates (given as "
                    "flags, or measured with --probe), and model load-vs-recompute per tier.")
    parser.add_argument("--layers", type=int, default=32, help="Model layers [default: 32].")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads [default: 8].")
    parser.add_argument("--head-dim", type=int, default=128, help="Head dim [default: 128].")
    parser.add_argument("--mla", action="store_true", help="MLA layout (one latent, no V).")
    for flag in _RATE_FLAGS:
        parser.add_argument(f"--{flag}", type=parse_rate, default=0.0, metavar="RATE",
                            help=f"{flag.replace('-', ' ')} in bytes/s, e.g. 2GB/s.")
    parser.add_argument("--disk-latency", type=float, default=0.0, metavar="S",
                        help="Disk tier fixed cost per read, seconds.")
    parser.add_argument("--remote-latency", type=float, default=0.0, metavar="S",
                        help="Remote tier round trip, seconds.")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=0.0, metavar="N",
                        help="Model prefill rate (enables the load-vs-recompute model).")
    parser.add_argument("--produce-tokens-per-s", type=float, default=None, metavar="N",
                        help="Tokens per second write-through commits [default: prefill rate].")
    parser.add_argument("--burst-margin", type=float, default=2.0,
                        help="Staging headroom over pages in flight [default: 2].")
    parser.add_argument("--pages-per-read", type=int, default=1,
                        help="Pages one IO worker reads per request [default: 1].")
    parser.add_argument("--hit-tokens", type=int, default=16384,
                        help="Hit length the cost model reports on [default: 16384].")
    parser.add_argument("--probe", action="store_true",
                        help="Measure host, disk and remote rates instead of assuming them.")
    parser.add_argument("--probe-bytes", type=parse_size, default=256 << 20, metavar="SIZE",
                        help="Bytes each probe moves [default: 256MiB].")
    parser.add_argument("--probe-dir", default="", help="Directory the disk probe writes in "
                        "[default: the disk tier's, else the temp dir].")
    parser.add_argument("--json", action="store_true", help="Print JSON instead of text.")
    add_config_flags(parser)
    parser.set_defaults(handler=run)


def layout_from(args: argparse.Namespace, config: KvtierConfig) -> KVLayout:
    dtype = config.engine.dtype if config.engine.dtype != "auto" else "bfloat16"
    return KVLayout(num_layers=args.layers, num_kv_heads=1 if args.mla else args.kv_heads,
                    head_dim=args.head_dim, dtype=dtype, page_size=config.cache.page_size,
                    mla=args.mla)


def inputs_from(args: argparse.Namespace, config: KvtierConfig,
                probed: dict[str, float]) -> PlanInputs:
    def rate(flag: str) -> float:
        return getattr(args, flag.replace("-", "_")) or probed.get(flag, 0.0)

    stores = []
    if config.store.disk_url or rate("disk-read-bw") or rate("disk-write-bw"):
        stores.append(StoreRates("disk", rate("disk-read-bw"), rate("disk-write-bw"),
                                 args.disk_latency or probed.get("disk-latency", 0.0)))
    if config.store.remote_url or rate("remote-read-bw") or rate("remote-write-bw"):
        stores.append(StoreRates("remote", rate("remote-read-bw"), rate("remote-write-bw"),
                                 args.remote_latency or probed.get("remote-latency", 0.0)))
    produce = args.produce_tokens_per_s
    return inputs_from_config(
        config, layout_from(args, config),
        pages_per_read=args.pages_per_read,
        burst_margin=args.burst_margin, host_read_bytes_per_s=rate("host-bw"),
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        produce_tokens_per_s=args.prefill_tokens_per_s if produce is None else produce,
        stores=tuple(stores))


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    probed: dict[str, float] = {}
    if args.probe:
        from kvtier.bench.rate_probes import probe_all

        probed = probe_all(config, args.probe_bytes, args.probe_dir)
    result = plan(inputs_from(args, config, probed), reference_hit_tokens=args.hit_tokens)
    if args.json:
        print(json.dumps({**result.to_dict(), "probed": probed}, indent=2))
    else:
        print(explain(result, probed))
    return 0 if result.fits_budget and result.sustainable is not False else 1


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _rate(n: float) -> str:
    return f"{n / 1e9:.2f} GB/s" if n else "unknown"


def explain(p: Plan, probed: dict[str, float] | None = None) -> str:
    """The plan in plain words, one decision per line."""
    lines = [f"page: {p.page_bytes} bytes ({p.bytes_per_token} bytes per token)"]
    for name, value in sorted((probed or {}).items()):
        lines.append(f"probed {name}: {value:.4g}")
    lines += [
        f"host pool: {p.host_pages} pages = {_gib(p.host_pool_bytes)}; "
        f"{p.prefetch_landing_pages} reserved for prefetch landing, "
        f"{p.staging_capacity_pages} bound write-through staging",
        f"read ring: {p.read_ring_slots} slots = {_gib(p.read_ring_bytes)} "
        "(landing slots taken before each read is issued)",
    ]
    if p.sustainable is False:
        lines.append("staging write slots: none is correct — write-through outruns a store")
    elif p.staging_write_slots is None:
        lines.append("staging write slots: unknown (give store write rates or --probe)")
    else:
        lines.append(f"staging write slots: {p.staging_write_slots} (drain x residency x margin, "
                     f"largest store; fits the staging share: {p.staging_fits})")
    for c in p.consumers:
        lines.append(f"  {c['name']}: drains {_rate(c['write_bytes_per_s'])} "
                     f"({c['drain_pages_per_s']:.3g} pages/s), residency "
                     f"{c['write_residency_s']:.3g} s, sustainable: {c['sustainable']}")
    verdict = "fits" if p.fits_budget else "DOES NOT FIT"
    lines.append(f"pinned: {_gib(p.pinned_bytes)} of {_gib(p.pinned_budget_bytes)} budget — "
                 f"{verdict}")
    lines += _explain_tiers(p)
    lines += [f"problem: {text}" for text in p.problems]
    return "\n".join(lines)


def _explain_tiers(p: Plan) -> list[str]:
    lines = []
    for t in p.tiers:
        if not t["read_bytes_per_s"]:
            lines.append(f"tier {t['name']}: read rate unknown (give --{t['name']}-"
                         f"{'bw' if t['name'] == 'host' else 'read-bw'} or --probe)")
            continue
        head = f"tier {t['name']}: {_rate(t['read_bytes_per_s'])} -> " \
               f"{t['load_tokens_per_s']:.4g} tokens/s loaded"
        if "speedup" in t:
            head += (f"; {t['load_over_prefill']:.2f}x prefill; a {t['reference_hit_tokens']}-token "
                     f"hit: recompute {t['recompute_share']:.0%}, load the rest, "
                     f"{t['speedup']:.2f}x faster than recompute")
        lines.append(head)
    return lines
