"""Rebuilding the host pool of a live cache (a new size, or a pool built elsewhere).

Owns ``rebuild_host_pool(admin, pool_bytes=..., new_pool=...)``. The host pool has five readers
(the controller's context, the copy engine, the IO workers, the index's host allocator, and the
prefetch and write-staging bounds derived from its size), and all of them move together inside
one ``BindingTable.swap``:

1. refuse, changing nothing, a pool whose layout differs from the device pool's
   (``LayoutMismatch`` names each difference), a pool that would not fit the pinned budget, or a
   host tier still in use (copies or IO jobs in flight, pages locked by a request);
2. drain copies and IO, drop the host tier's pages from the index;
3. swap: build the new pool (after closing the old one when both would not fit the budget),
   point every reader at it, restart the IO workers on it, close the old pool.

If a step fails, the host tier is disabled instead (no pool, no copy engine, no workers, and
the store tiers unbound since they only talk to the host tier): logged, counted, and
``SwapFailed`` raised. Engine thread only, with the server idle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.admin.bindings import Later, check_host_shape
from kvtier.admin.reconfig_support import STORE_TIERS, Busy, Unsupported
from kvtier.controller.wiring import bind_host_pool

if TYPE_CHECKING:
    from kvtier.admin.reconfig import StorageAdmin
    from kvtier.memory.host_pool import HostPool
    from kvtier.memory.pinned import PinnedBudget


def rebuild_host_pool(admin: StorageAdmin, *, pool_bytes: int | None = None,
                      new_pool: HostPool | None = None) -> dict[str, object]:
    """Replace the host pool by one of ``pool_bytes`` (or by ``new_pool``); see the module
    docstring. Returns old and new page counts and the new generation."""
    ctx, cache = admin.ctx, admin.cache
    old = ctx.host_pool
    if old is None:
        raise Busy("the host tier is off (host.pool_bytes 0 at start, or disabled after a failed "
                   "swap); restart the server to turn it on")
    if new_pool is not None:
        check_host_shape(new_pool, ctx.device_pool)
        need = 0
    else:
        pages = int(pool_bytes or 0) // old.page_bytes
        if pages < 1:
            raise Unsupported(f"pool_bytes {pool_bytes} holds no page of {old.page_bytes} bytes")
        need = pages * old.page_bytes
        if cache.pinned_budget is None:
            raise Unsupported("this cache has no pinned budget to lease a new host pool from; "
                              "pass new_pool")
        _check_budget(cache.pinned_budget, need, old)
    _empty_host_tier(admin)
    box: dict[str, HostPool | None] = {"pool": new_pool}
    first_close = need > _available(cache.pinned_budget)

    def build() -> None:
        if first_close:
            old.close()
        if box["pool"] is None:
            assert cache.pinned_budget is not None  # checked above
            box["pool"] = _new_pool(old, need // old.page_bytes, cache.pinned_budget)

    def built() -> HostPool:
        pool = box["pool"]
        assert pool is not None, "the build step ran first"
        return pool

    binding = admin.table.swap(
        "host_pool", Later(lambda: (built(), {"allocator": built().allocator})),
        [build, lambda: bind_host_pool(admin.ctx, box["pool"], admin.config), lambda: _close(old)],
        lambda: _disable_host(admin, box.get("pool")),
        detail="rebuilt")
    pool = built()
    return {"old_pages": old.num_pages, "new_pages": pool.num_pages,
            "page_bytes": pool.page_bytes, "generation": binding.generation}


def _available(budget: PinnedBudget | None) -> int:
    return budget.available_bytes if budget is not None else 1 << 62


def _check_budget(budget: PinnedBudget | None, need: int, old: HostPool) -> None:
    if budget is None:
        return
    room = _available(budget) + old.num_pages * old.page_bytes
    if need > room:
        raise Busy(f"a host pool of {need} bytes does not fit the pinned budget: {room} bytes "
                   "are free with the old pool given back (raise host.pinned_budget_bytes)")


def _empty_host_tier(admin: StorageAdmin) -> None:
    ctx, controller = admin.ctx, admin.controller
    if not controller.drain(ctx.config.job_deadline_s):
        raise Busy("copies or IO jobs are still in flight; retry")
    ctx.index.clear("host")
    held = ctx.index.sizes("host").resident
    if held or ctx.host_outside or controller.prefetcher.tasks:
        raise Busy(f"the host tier is in use ({held} pages locked, {ctx.host_outside} held by "
                   "copies or jobs); retry when the server is idle")


def _new_pool(old: HostPool, pages: int, budget: PinnedBudget) -> HostPool:
    from kvtier.memory import HostPool

    return HostPool(old.layout, pages, budget, host_layout=old.host_layout)


def _close(pool: HostPool) -> None:
    if not pool.closed:
        pool.close()


def _disable_host(admin: StorageAdmin, new_pool: HostPool | None) -> None:
    """Leave no reader holding any host pool, and unbind the stores (they need the host)."""
    ctx, table = admin.ctx, admin.table
    pools = (ctx.host_pool, new_pool)
    bind_host_pool(ctx, None, admin.config)   # the IO workers stop before their pool closes
    for pool in pools:
        if pool is not None:
            _close(pool)
    for tier in STORE_TIERS:
        store = ctx.stores.get(tier)
        if store is not None:
            admin.unbind_store(tier)
            store.close()
            table.bind(admin.slot(tier), None, detail="disabled",
                       disabled="the host tier was disabled")
