"""Write-back at close: the pages only memory holds go to the stores before the cache closes.

Owns ``flush_to_stores`` and ``tell_flush``. Under ``write_back`` a page gets a host copy (and
from there a store backup) only when the device evicts it, so a cache that closes would lose
every page the device never had to evict. At close (``TieredCache.close``: a graceful stop of ``kvtier
serve`` on SIGTERM or SIGINT, or a normal exit) each prompt path the device holds is copied to
host where the host lacks it and backed up (the write policy's own copy and ``Backups``), path
after path, until every open store tier holds every page or ``controller.close_flush_s`` runs
out. Host room comes from evicting host pages already backed up: before a path needs more host
pages than are free, the backups in flight are drained. What is still not in some store when
the bound runs out (or cannot be copied for want of host room) and the backups still in flight
then have ended is counted (``close_flush_dropped_pages_total.<tier>``) and logged with its pages
and bytes (``tell_flush``).

Engine thread: the thread that closes the cache (the engine has stopped by then).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.controller.context import CacheContext, path_of, split_keys
from kvtier.controller.writes import HostWriter
from kvtier.index.residency import TIER_INDEX, Node
from kvtier.keys import PageKey

log = logging.getLogger(__name__)

DEVICE = TIER_INDEX["device"]


@dataclass
class FlushReport:
    """What a flush at close did: pages copied to host, and per store tier the pages (and
    bytes) memory still held that the tier lacks once it ended."""

    tiers: list[str]
    bound_s: float
    copied: int = 0
    seconds: float = 0.0
    missing_pages: dict[str, int] = field(default_factory=dict)
    missing_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return not any(self.missing_pages.values())


def flush_to_stores(ctx: CacheContext, writer: HostWriter, drain: Callable[[float], bool],
                    bound_s: float) -> FlushReport | None:
    """Back up every device page some open store lacks, within ``bound_s`` seconds; ``drain``
    waits for the backups in flight (at most its argument, in seconds). None when there is
    nothing to do (another write policy, no store, no host tier, or a bound of 0)."""
    tiers = [tier for tier, store in ctx.stores.items() if store.available]
    if (writer.policy != "write_back" or not tiers or not ctx.has_host or ctx.workers is None
            or bound_s <= 0):
        return None
    start = time.monotonic()
    deadline = start + bound_s
    report = FlushReport(tiers, bound_s)
    for data, salt, keys in _device_paths(ctx):
        if time.monotonic() >= deadline:
            break
        match = ctx.index.match(data, salt)
        depth = match.depth_of("device")
        if all(match.depth_of(tier) >= depth for tier in tiers):
            continue
        if match.depth_of("host") >= depth:  # on host already: only the backup is missing
            writer.backups.want(data, salt, keys, match)
            continue
        while match.depth_of("host") < depth and time.monotonic() < deadline:
            if (ctx.index.sizes("host").free or 0) < depth - match.depth_of("host"):
                drain(max(deadline - time.monotonic(), 0.0))  # backed-up host pages: evictable
            copied = writer.copy(data, salt, keys, depth, wait=True)  # backs them up too
            report.copied += copied
            if copied == 0:
                break  # no host room even after the drain: counted below as missing
            match = ctx.index.match(data, salt)
    drain(max(deadline - time.monotonic(), 0.0))
    report.seconds = time.monotonic() - start
    return report


def _device_paths(ctx: CacheContext) -> list[tuple[bytes, bytes, list[PageKey]]]:
    """(tokens, salt, keys) of the path to every deepest node the device holds."""
    leaves = [node for node in ctx.index.iter_nodes()
              if node.res[DEVICE] is not None and node.kids[DEVICE] == 0 and node.keys]
    out = []
    for node in leaves:
        data, raw_keys = path_of(node)
        out.append((data, node.salt, split_keys(raw_keys)))
    return out


def tell_flush(ctx: CacheContext, report: FlushReport) -> None:
    """Count and log what the flush left out: call it once the backups in flight have ended
    and been reaped (after the IO workers stopped), so that pages a backup still wrote past the
    bound count as stored."""
    page_bytes = ctx.device_pool.layout.page_bytes
    nodes: list[Node] = [n for n in ctx.index.iter_nodes()
                         if n.res[DEVICE] is not None or n.res[TIER_INDEX["host"]] is not None]
    for tier in report.tiers:
        t = TIER_INDEX[tier]
        pages = sum(n.pages for n in nodes if n.res[t] is None)
        report.missing_pages[tier] = pages
        report.missing_bytes[tier] = pages * page_bytes
    ctx.count("close_flush_total")
    ctx.count("close_flush_host_copy_pages_total", report.copied)
    if report.complete:
        log.info("write-back flush at close: every page the cache held is in its stores "
                 "(%d pages copied to host, %.2fs)", report.copied, report.seconds)
        return
    for tier, pages in report.missing_pages.items():
        if pages:
            ctx.count(f"close_flush_dropped_pages_total.{tier}", pages)
            log.warning("write-back flush at close: %d pages (%d bytes) the cache held are not "
                        "in the %s store and are lost (bound controller.close_flush_s=%gs, "
                        "%.2fs spent)", pages, report.missing_bytes[tier], tier, report.bound_s,
                        report.seconds)
