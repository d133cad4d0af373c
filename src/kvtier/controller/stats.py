"""``TieredCache.stats()``: one plain-data snapshot of the cache (pulled, never pushed).

Owns ``cache_stats``: per-tier pages (resident, evictable, protected, free), index shape, hits
and prefetch outcomes (counters named ``a.b`` become nested ``{"a": {"b": n}}``), stores and
their health, workers, write admission, copy engine, pinned bytes and rank agreement; and
``store_health`` (the guards' states alone, any thread). ``kvtier.metrics`` turns the snapshot
into Prometheus series. Engine thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.controller.context import CacheContext
from kvtier.index.residency import TIERS

if TYPE_CHECKING:
    from kvtier.controller.controller import CacheController
    from kvtier.memory.pinned import PinnedBudget


def nest_counters(counters: dict[str, int]) -> dict[str, object]:
    """``{"prefetch_total.timeout": 2}`` -> ``{"prefetch_total": {"timeout": 2}}``."""
    out: dict[str, object] = {}
    for name, value in sorted(counters.items()):
        head, _, rest = name.partition(".")
        if rest:
            slot = out.setdefault(head, {})
            if isinstance(slot, dict):
                for part in rest.split(".")[:-1]:
                    slot = slot.setdefault(part, {})
                slot[rest.split(".")[-1]] = value
        else:
            out[head] = value
    return out


def store_health(ctx: CacheContext) -> dict[str, dict[str, object]]:
    """Per supervised store tier: its guard's ``health()`` (state on / degraded / off, the
    problems, when it is retried). Any thread: guards are thread-safe."""
    out = {}
    for tier, store in list(ctx.stores.items()):
        health = store.health()
        if health is not None:
            out[tier] = health
    return out


def cache_stats(ctx: CacheContext, controller: CacheController,
                pinned_budget: PinnedBudget | None) -> dict[str, object]:
    index = ctx.index
    tiers = {}
    for tier in TIERS:
        sizes = index.sizes(tier)
        tiers[tier] = {"pages": sizes.resident, "evictable": sizes.evictable,
                       "protected": sizes.protected, "free": sizes.free,
                       "tokens": sizes.resident * ctx.page_size}
    out: dict[str, object] = {
        "page_size": ctx.page_size,
        "write_policy": ctx.config.write_policy,
        "prefetch_policy": ctx.config.prefetch_policy,
        "tiers": tiers,
        "index": {"nodes": sum(1 for _ in index.iter_nodes()), "salts": len(index.roots())},
        "outside_index": controller.outstanding(),
        "counters": nest_counters(dict(ctx.counters)),
        "stores": {tier: store.stats().as_dict() for tier, store in ctx.stores.items()},
        "store_health": store_health(ctx),
        "ranks": {"distributed": controller.ranks.distributed,
                  "collective_calls": controller.ranks.calls},
        "rates": {"prefill_tokens_per_s": ctx.rates.prefill_tokens_per_s if ctx.rates else None,
                  "read_bytes_per_s": {t: r for t, (r, _) in ctx.rates.rates.items()}
                  if ctx.rates else {},
                  "fixed_s_per_load": {t: f for t, (_, f) in ctx.rates.rates.items()}
                  if ctx.rates else {},
                  "split_late_s_by_size": {f"<{1 << b}": v for b, v in
                                           sorted(ctx.rates.split_errors.items())}
                  if ctx.rates else {}},
    }
    if ctx.workers is not None:
        out["workers"] = ctx.workers.stats()
    if ctx.admission is not None:
        out["write_admission"] = ctx.admission.stats()
    selection = controller.writer.admission.stats()
    if selection:
        out["write_selection"] = selection
    if ctx.copy is not None:
        out["copy"] = ctx.copy.stats()
    if pinned_budget is not None:
        out["pinned"] = pinned_budget.stats()
    return out
