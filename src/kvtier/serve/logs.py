"""The server's log lines: one per request, a periodic stats line, the start-up summary of tiers.

Owns the text of those lines (pure functions over plain data, so tests read them without a
server) and ``log_stats_every``, the asyncio task that logs a stats line every
``server.stats_interval_s`` seconds (0: off) while anything happened since the previous one:
prompt and generation throughput over the interval, running and queued requests, the share of
the interval's prompt tokens each tier served, and pages per tier (device and host from the
index, disk and remote as the stores count them). ``tiers_summary`` runs on the engine thread;
the rest on the server's event loop. Logger ``kvtier.requests`` for request lines,
``kvtier.stats`` for the rest.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from kvtier.units import redact_url

TIERS = ("device", "host", "disk", "remote")
STATS_TIMEOUT_S = 5.0
request_log = logging.getLogger("kvtier.requests")
stats_log = logging.getLogger("kvtier.stats")


def _size(count: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def request_line(request_id: str, outcome: str, prompt_tokens: int, report: Any,
                 generated: int, ttft_s: float | None, total_s: float) -> str:
    """'cmpl-1: stop, prompt 481 tokens (cached 448: device 448), generated 16, TTFT 9.1 ms,
    total 80.2 ms'. ``report`` is the ``PrefillReport`` (None: the request never prefilled)."""
    cached = report.cached_tokens if report is not None else 0
    by_tier = ", ".join(f"{tier} {n}" for tier, n in report.cached_by_tier.items() if n) \
        if report is not None else ""
    return (f"{request_id}: {outcome}, prompt {prompt_tokens} tokens (cached {cached}"
            f"{': ' + by_tier if by_tier else ''}), generated {generated}, TTFT {_ms(ttft_s)}, "
            f"total {_ms(total_s)}")


def stats_line(before: dict[str, Any], after: dict[str, Any], seconds: float) -> str:
    """The stats line for the interval between two ``activity`` snapshots."""
    req0, req1 = before["requests"], after["requests"]
    prompt = req1["prompt_tokens_total"] - req0["prompt_tokens_total"]
    generated = req1["completion_tokens_total"] - req0["completion_tokens_total"]
    span = max(seconds, 1e-9)
    hits = []
    for tier in TIERS:
        cached = req1["cached_tokens_total"].get(tier, 0) - req0["cached_tokens_total"].get(tier, 0)
        hits.append(f"{tier} {cached / prompt:.1%}" if prompt else f"{tier} -")
    pages = after.get("pages")
    shown = ", ".join(f"{t} {pages[t]}" for t in TIERS if t in pages) if pages else "unknown"
    sched = after["scheduler"]
    return (f"prompt {prompt / span:.1f} tokens/s, generation {generated / span:.1f} tokens/s, "
            f"running {sched['running']}, queued {sched['queued']}; hit rate "
            f"{', '.join(hits)}; pages {shown}")


def changed(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """Whether a stats line says anything new: requests ended, ran, waited or pages moved."""
    busy = after["scheduler"]["running"] or after["scheduler"]["queued"]
    return bool(busy) or before["requests"] != after["requests"] or \
        before.get("pages") != after.get("pages")


def pages_by_tier(cache_stats: dict[str, Any]) -> dict[str, int]:
    """Pages per tier from ``TieredCache.stats()``: pools from the index, stores as counted."""
    tiers = cache_stats.get("tiers") or {}
    out = {t: int(tiers[t]["pages"]) for t in ("device", "host") if t in tiers}
    for tier, st in (cache_stats.get("stores") or {}).items():
        out[tier] = int(st.get("pages", 0))
    return out


async def activity(service: Any) -> dict[str, Any]:
    """Requests, scheduler and pages per tier now (pages: None if the engine does not answer)."""
    scheduler = service.scheduler
    snap: dict[str, Any] = {"requests": scheduler.requests.snapshot(),
                            "scheduler": scheduler.stats(), "pages": None}
    prefix = getattr(service, "prefix_cache", None)
    if prefix is not None:
        try:
            future = scheduler.call_soon(lambda: pages_by_tier(prefix.tiered.stats()))
            snap["pages"] = await asyncio.wait_for(asyncio.wrap_future(future), STATS_TIMEOUT_S)
        except Exception as exc:  # the engine is busy or stopping: the line says so
            stats_log.debug("no page counts for the stats line: %s", exc)
    return snap


async def log_stats_every(service: Any, interval_s: float) -> None:
    """Log ``stats_line`` every ``interval_s`` seconds while something changed; runs until
    cancelled."""
    before, since = await activity(service), time.monotonic()
    while True:
        await asyncio.sleep(interval_s)
        after, now = await activity(service), time.monotonic()
        if changed(before, after):
            stats_log.info(stats_line(before, after, now - since))
        before, since = after, now


def tiers_summary(service: Any) -> str:
    """One line naming every tier with its size and, for stores, the pages found there
    (engine thread: it reads the pools and the stores)."""
    prefix = service.prefix_cache
    if prefix is None:
        return "tiers: cache off (--no-cache), every prompt is computed"
    tiered, store_config = prefix.tiered, service.config.store
    device = tiered.device_pool
    parts = [f"device {device.num_pages} pages "
             f"({_size(device.num_pages * device.layout.page_bytes)}, {service.lm.device})"]
    host = tiered.host_pool
    parts.append(f"host {host.num_pages} pages ({_size(host.nbytes)})" if host is not None
                 else "host off")
    for tier, url in (("disk", store_config.disk_url), ("remote", store_config.remote_url)):
        store = tiered.store(tier)
        if store is None:
            parts.append(f"{tier} off")
            continue
        health = store.health()
        if health is not None and health.get("state") == "off":
            why = ", ".join(health.get("problems") or {}) or "unavailable"
            parts.append(f"{tier} {redact_url(url)}: off ({why}; retried in the background)")
            continue
        st = store.stats()
        cap = f" of {_size(st.capacity_bytes)}" if st.capacity_bytes else ""
        parts.append(f"{tier} {redact_url(url)}: {st.pages} pages found "
                     f"({_size(st.bytes)}{cap})")
    return "tiers: " + "; ".join(parts)
