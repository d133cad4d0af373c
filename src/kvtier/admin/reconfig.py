"""Runtime storage changes on a live cache: attach, detach, clear and resize stores, flush tiers.

Owns ``StorageAdmin``, built over a ``TieredCache``. It binds every slot in a ``BindingTable``
(``host_pool``, ``device_pool``, ``store.disk``, ``store.remote``) and registers the readers
that hold them: the controller's context, the copy engine, the IO workers and their live jobs,
the index (its host and device allocators, and the store marks it keeps for each store tier)
and, when given, the engine (``engine_holds`` returns the device KV tensor it reads). Every
change goes through ``BindingTable.swap``, so a change that fails part-way disables the tier
instead of leaving it half-bound, and a coherence check follows every change.

- ``attach`` opens a store (config defaults < URL query < ``max_bytes``) and binds it, starting
  the IO workers if none run yet; the index starts with no marks for the tier.
- ``detach`` stops new work on the tier, cancels the jobs using it and waits for them (a write
  in progress finishes or is dropped whole: stores publish a page only once it is complete), then
  unbinds it, drops the index's marks and closes the store. Jobs still running past the wait:
  ``Busy``, and the store stays attached.
- ``clear`` does the same without unbinding: it empties the store and drops the index's marks.
- ``resize`` changes a store's byte cap (``PageStore.resize``) and needs no engine thread.
- ``flush`` drops the device and host tiers (``TieredCache.flush``).

Idleness (no queued or running requests) is the caller's check: the server asks the scheduler
before ``attach`` and ``detach``. Everything but ``resize`` runs on the engine thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvtier.admin.bindings import ABSENT, BindingTable, Reader
from kvtier.admin.reconfig_support import (
    STORE_TIERS,
    Busy,
    NotAttached,
    Paused,
    Unsupported,
    describe_url,
    open_tier_store,
    redact_store_url,
    usage_and_health,
)
from kvtier.config import KvtierConfig
from kvtier.controller.jobs import Job
from kvtier.controller.wiring import bind_store
from kvtier.index.residency import TIER_INDEX, Allocator
from kvtier.store.base import PageStore, Resizable

if TYPE_CHECKING:
    from kvtier.cache import TieredCache

__all__ = ["Busy", "NotAttached", "StorageAdmin", "Unsupported"]


class StorageAdmin:
    """See the module docstring."""

    def __init__(self, cache: TieredCache, config: KvtierConfig, *,
                 engine_holds: Callable[[], object] | None = None) -> None:
        self.cache = cache
        self.ctx = cache.ctx
        self.controller = cache.controller
        self.config = config
        self.table = BindingTable()
        self.urls: dict[str, str] = {}
        self._marks: dict[str, PageStore | None] = {}  # tier -> the store the index's marks describe
        self._bind_initial()
        self._register_readers(engine_holds)
        self.table.assert_coherent()

    # ---- set-up ----------------------------------------------------------------------------
    def _bind_initial(self) -> None:
        ctx = self.ctx
        self.table.bind("device_pool", ctx.device_pool,
                        facets={"allocator": ctx.device_pool.allocator, "kv": ctx.device_pool.kv})
        pool = ctx.host_pool
        self.table.bind("host_pool", pool, facets={"allocator": pool.allocator} if pool else None,
                        detail=f"{pool.num_pages} pages" if pool else "off")
        for tier in STORE_TIERS:
            store = ctx.stores.get(tier)
            if store is not None:
                self.urls[tier] = describe_url(store)
                self._marks[tier] = store
            self.table.bind(self.slot(tier), store, detail=self.urls.get(tier, "none"))

    def _register_readers(self, engine_holds: Callable[[], object] | None) -> None:
        ctx, add = self.ctx, self.table.register
        add(Reader("controller", "device_pool", lambda: ctx.device_pool))
        add(Reader("index", "device_pool", lambda: self._allocator("device"), "allocator"))
        add(Reader("copy_engine", "device_pool",
                   lambda: ABSENT if ctx.copy is None else ctx.copy.device_pool))
        if engine_holds is not None:
            add(Reader("engine", "device_pool", engine_holds, "kv"))
        add(Reader("controller", "host_pool", lambda: ctx.host_pool))
        add(Reader("index", "host_pool", lambda: self._allocator("host"), "allocator"))
        add(Reader("copy_engine", "host_pool",
                   lambda: None if ctx.copy is None else ctx.copy.host_pool))
        add(Reader("io_workers", "host_pool",
                   lambda: ABSENT if ctx.workers is None else ctx.workers.host_pool))
        for tier in STORE_TIERS:
            self._register_store_readers(tier)

    def _register_store_readers(self, tier: str) -> None:
        ctx, slot, add = self.ctx, self.slot(tier), self.table.register
        add(Reader("controller", slot, lambda: ctx.stores.get(tier)))
        add(Reader("io_jobs", slot, lambda: self._live_job_store(tier)))
        add(Reader("index", slot, lambda: self._marks.get(tier)
                   if ctx.index.sizes(tier).resident else ABSENT))

    @staticmethod
    def slot(tier: str) -> str:
        return f"store.{tier}"

    def _allocator(self, tier: str) -> Allocator | None:
        return self.ctx.index.ledgers[TIER_INDEX[tier]].allocator

    def _live_job_store(self, tier: str) -> object:
        """The store a queued or running IO job of ``tier`` uses (ABSENT: no such job)."""
        for task in list(self.controller.backups.tasks.values()):
            if task.job.tier == tier and not task.job.is_done():
                return task.job.store
        for prefetch in list(self.controller.prefetcher.tasks.values()):
            if not prefetch.job.is_done():
                for segment in prefetch.job.segments:
                    if segment.tier == tier:
                        return segment.store
        return ABSENT

    # ---- queries -----------------------------------------------------------------------------
    def storage(self) -> list[dict[str, object]]:
        """Per store tier: attached or not, URL (redacted), usage, cap, health, generation."""
        rows = []
        for tier in STORE_TIERS:
            binding = self.table.current(self.slot(tier))
            store = self.ctx.stores.get(tier)
            row: dict[str, object] = {"tier": tier, "attached": store is not None,
                                   "url": self.urls.get(tier) if store is not None else None,
                                   "generation": binding.generation,
                                   "disabled": binding.disabled or None}
            if store is not None:
                row.update(usage_and_health(store))
            rows.append(row)
        return rows

    # ---- changes (engine thread) ---------------------------------------------------------------
    def attach(self, tier: str, url: str, max_bytes: int | None = None) -> dict[str, object]:
        self._check_tier(tier)
        if self.ctx.stores.get(tier) is not None:
            raise Busy(f"the {tier} tier already has a store ({self.urls.get(tier)}); detach it "
                       "first")
        if not self.ctx.has_host:
            raise Busy("the host tier is off (host.pool_bytes 0): stores exchange pages with the "
                       "host tier only")
        store = open_tier_store(self.config, self.ctx.device_pool.layout, tier, url, max_bytes)
        shown = redact_store_url(url)

        def disable() -> None:
            self.unbind_store(tier)
            store.close()

        binding = self.table.swap(self.slot(tier), store, [
            lambda: self._reset_marks(tier, store),
            lambda: self.controller.backups.in_flight.setdefault(tier, set()),
            lambda: bind_store(self.ctx, tier, store, self.config),
        ], disable, detail=shown)
        self.urls[tier] = shown
        return {"tier": tier, "attached": shown, "generation": binding.generation}

    def detach(self, tier: str, wait_s: float | None = None) -> dict[str, object]:
        store = self._attached(tier)
        url = self.urls.get(tier)
        with self._paused(tier, store, restore_on_success=False):
            cancelled = self._quiesce(tier, wait_s)

        def disable() -> None:
            self.unbind_store(tier)

        try:
            binding = self.table.swap(self.slot(tier), None, [
                lambda: self.ctx.stores.pop(tier, None),
                lambda: self.controller.backups.in_flight.pop(tier, None),
                lambda: self._reset_marks(tier, None),
            ], disable, detail="none")
        finally:
            store.close()
            self.urls.pop(tier, None)
        return {"tier": tier, "detached": url, "cancelled_jobs": cancelled,
                "generation": binding.generation}

    def clear(self, tier: str, wait_s: float | None = None) -> dict[str, object]:
        store = self._attached(tier)
        clear = getattr(store, "clear", None)
        if not callable(clear):
            raise Unsupported(f"the {store.scheme} backend of the {tier} tier cannot be cleared "
                              "from kvtier (a shared server may hold other users' keys); expire "
                              "or delete its keys on the server")
        with self._paused(tier, store, restore_on_success=True):
            cancelled = self._quiesce(tier, wait_s)
            before = store.stats().pages
            clear()
            self._reset_marks(tier, store)
        self.table.assert_coherent(self.slot(tier))
        return {"tier": tier, "pages_before": before, "pages_after": store.stats().pages,
                "cancelled_jobs": cancelled}

    def flush(self) -> dict[str, object]:
        return {"dropped_pages": self.cache.flush()}

    def store_to_resize(self, tier: str) -> PageStore:
        """The attached store of ``tier`` (engine thread); ``resize`` then runs anywhere."""
        store = self._attached(tier)
        _resizable(tier, store)
        return store

    @staticmethod
    def resize(tier: str, store: PageStore, max_bytes: int) -> dict[str, object]:
        """Set the cap; a shrink evicts until the store fits and returns when it does."""
        before = store.stats()
        result = _resizable(tier, store).resize(max_bytes)
        after = store.stats()
        return {"tier": tier, "max_bytes": max_bytes, "pages_before": before.pages,
                "pages_after": after.pages, "bytes_before": before.bytes,
                "bytes_after": after.bytes, "evicted_pages": max(0, before.pages - after.pages),
                **(result if isinstance(result, dict) else {})}

    # ---- helpers -------------------------------------------------------------------------------
    def _check_tier(self, tier: str) -> None:
        if tier not in STORE_TIERS:
            raise Unsupported(f"tier must be one of {', '.join(STORE_TIERS)}, got {tier!r}")

    def _attached(self, tier: str) -> PageStore:
        self._check_tier(tier)
        store = self.ctx.stores.get(tier)
        if store is None:
            raise NotAttached(f"no store is attached to the {tier} tier")
        return store

    def _reset_marks(self, tier: str, owner: PageStore | None) -> None:
        """Forget what the index believes ``tier`` holds; the marks now describe ``owner``."""
        self.ctx.index.clear(tier)
        self._marks[tier] = owner

    def unbind_store(self, tier: str) -> None:
        self.ctx.stores.pop(tier, None)
        self.controller.backups.in_flight.pop(tier, None)
        self.ctx.index.clear(tier)
        self._marks[tier] = None

    def _paused(self, tier: str, store: PageStore, *, restore_on_success: bool) -> Paused:
        return Paused(self.ctx.stores, tier, store, restore_on_success)

    def _quiesce(self, tier: str, wait_s: float | None) -> int:
        """Cancel the IO jobs using ``tier`` and wait until none runs; returns jobs cancelled."""
        jobs: list[Job] = [t.job for t in self.controller.backups.tasks.values()
                           if t.job.tier == tier]
        jobs += [t.job for t in self.controller.prefetcher.tasks.values()
                 if any(s.tier == tier for s in t.job.segments)]
        live = [job for job in jobs if not job.is_done()]
        for job in live:
            job.cancel()
        limit = self.config.controller.job_deadline_s + 1.0 if wait_s is None else wait_s
        deadline = time.monotonic() + limit
        while any(not job.is_done() for job in live):
            if time.monotonic() > deadline:
                running = sum(not job.is_done() for job in live)
                raise Busy(f"{running} IO jobs on the {tier} tier did not stop within {limit:.1f} s "
                           "(cancelled; the store may be hanging); retry")
            time.sleep(0.002)
        self.controller.poll()
        return len(live)


def _resizable(tier: str, store: PageStore) -> Resizable:
    if not isinstance(store, Resizable):
        raise Unsupported(f"the {store.scheme} backend of the {tier} tier has no kvtier-side "
                          "cap (a redis tier's capacity is the server's maxmemory)")
    return store
