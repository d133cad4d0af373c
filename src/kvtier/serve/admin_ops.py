"""What the admin routes and ``/metrics`` do, between the event loop and the engine thread.

Owns ``AdminOps``: it runs cache changes and snapshots on the engine thread
(``Scheduler.call_soon``, awaited with a timeout), checks idleness there (no queued or running
request) before attach, detach and host-pool rebuilds, builds the ``StorageAdmin`` on first use,
and maps refusals onto HTTP errors: ``Busy`` 409, ``NotAttached`` 404, ``Unsupported`` and bad
URLs 400, an unreachable store 503, a swap that failed part-way 500 (the tier is then disabled).
Resizes run on a worker thread (they need neither the engine thread nor idleness). Runs on the
server's event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kvtier.admin.bindings import SwapFailed
from kvtier.admin.reconfig_support import Busy, NotAttached, Unsupported
from kvtier.config import KvtierConfig
from kvtier.engine.engine_calls import EngineStopped
from kvtier.errors import ConfigError, LayoutMismatch, StoreClosed, StoreUnavailable
from kvtier.serve.errors import APIError
from kvtier.serve.process_stats import process_snapshot

ENGINE_TIMEOUT_S = 60.0
SNAPSHOT_TIMEOUT_S = 5.0

_ERRORS: tuple[tuple[type[BaseException], int, str], ...] = (
    (Busy, 409, "busy"), (NotAttached, 404, "not_attached"), (Unsupported, 400, "unsupported"),
    (LayoutMismatch, 400, "layout_mismatch"), (ConfigError, 400, "invalid_store"),
    (StoreUnavailable, 503, "store_unavailable"), (SwapFailed, 500, "swap_failed"),
    (EngineStopped, 503, "engine_stopped"), (StoreClosed, 409, "store_detached"),
)


def as_api_error(exc: BaseException) -> APIError | None:
    for kind, status, code in _ERRORS:
        if isinstance(exc, kind):
            return APIError(status, str(exc), code=code)
    return None


class AdminOps:
    """See the module docstring."""

    def __init__(self, service: Any, config: KvtierConfig) -> None:
        self.service = service
        self.config = config
        self._admin: Any = None

    @property
    def tiered(self) -> Any:
        prefix = getattr(self.service, "prefix_cache", None)
        return None if prefix is None else prefix.tiered

    # ---- the engine thread ---------------------------------------------------------------------
    async def on_engine(self, fn: Callable[[], Any], timeout_s: float = ENGINE_TIMEOUT_S) -> Any:
        """Run ``fn`` on the engine thread; kvtier refusals become HTTP errors."""
        future = self.service.scheduler.call_soon(fn)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except TimeoutError:
            future.cancel()
            raise APIError(503, f"the engine thread did not answer within {timeout_s:.0f} s",
                           code="engine_busy") from None
        except Exception as exc:
            mapped = as_api_error(exc)
            if mapped is None:
                raise
            raise mapped from None

    def storage_admin(self) -> Any:
        """The ``StorageAdmin`` (engine thread); 409 when the cache is off."""
        tiered = self.tiered
        if tiered is None:
            raise Busy("the cache is off (cache.enabled=false): there is no storage to manage")
        if self._admin is None:
            from kvtier.admin.reconfig import StorageAdmin

            prefix = self.service.prefix_cache
            self._admin = StorageAdmin(tiered, self.config, engine_holds=lambda: prefix.pool)
        return self._admin

    def require_idle(self, action: str) -> None:
        """Engine thread: raise ``Busy`` with the counts unless no request is queued or running."""
        stats = self.service.scheduler.stats()
        if stats["queued"] or stats["running"]:
            raise Busy(f"cannot {action} while requests are in progress ({stats['queued']} "
                       f"queued, {stats['running']} running); retry when the server is idle")

    # ---- operations --------------------------------------------------------------------------
    async def storage(self) -> dict[str, Any]:
        def view() -> dict[str, Any]:
            admin = self.storage_admin()
            host = admin.cache.host_pool
            return {"stores": admin.storage(),
                    "host": {"pages": host.num_pages if host else 0,
                             "bytes": host.num_pages * host.page_bytes if host else 0,
                             "generation": admin.table.current("host_pool").generation}}
        return await self.on_engine(view)

    async def attach(self, tier: str, url: str, max_bytes: int | None) -> dict[str, Any]:
        def change() -> dict[str, Any]:
            self.require_idle(f"attach a store to the {tier} tier")
            return self.storage_admin().attach(tier, url, max_bytes)
        return await self.on_engine(change)

    async def detach(self, tier: str) -> dict[str, Any]:
        def change() -> dict[str, Any]:
            self.require_idle(f"detach the {tier} tier's store")
            return self.storage_admin().detach(tier)
        return await self.on_engine(change)

    async def resize(self, tier: str, max_bytes: int) -> dict[str, Any]:
        admin = await self.on_engine(self.storage_admin)
        store = await self.on_engine(lambda: admin.store_to_resize(tier))
        try:
            return await asyncio.to_thread(admin.resize, tier, store, max_bytes)
        except Exception as exc:
            mapped = as_api_error(exc)
            if mapped is None:
                raise
            raise mapped from None

    async def clear(self, tier: str) -> dict[str, Any]:
        return await self.on_engine(lambda: self.storage_admin().clear(tier))

    async def flush(self) -> dict[str, Any]:
        return await self.on_engine(lambda: self.storage_admin().flush())

    async def rebuild_host(self, pool_bytes: int) -> dict[str, Any]:
        from kvtier.admin.host_rebuild import rebuild_host_pool

        def change() -> dict[str, Any]:
            self.require_idle("rebuild the host pool")
            return rebuild_host_pool(self.storage_admin(), pool_bytes=pool_bytes)
        return await self.on_engine(change)

    async def bindings(self) -> dict[str, Any]:
        def check() -> dict[str, Any]:
            table = self.storage_admin().table
            return {**table.stats(), "lags": [str(lag) for lag in table.check()]}
        return await self.on_engine(check)

    # ---- snapshots ---------------------------------------------------------------------------
    async def snapshot(self, http: Any = None) -> dict[str, Any]:
        """Everything ``/metrics`` and ``/admin/stats`` show; the cache part comes from the
        engine thread and is left out if it does not answer within ``SNAPSHOT_TIMEOUT_S``."""
        from kvtier import __version__

        scheduler = self.service.scheduler
        snap: dict[str, Any] = {
            "info": {"version": __version__, "model": self.service.model_name},
            "requests": scheduler.requests.snapshot(), "scheduler": scheduler.stats(),
            "http": http.snapshot() if http is not None else {}, "process": process_snapshot(),
            "cache": None, "bindings": {},
            "kv_events": self.service.kv_events_stats()}

        def engine_part() -> dict[str, Any]:
            tiered = self.tiered
            if tiered is None:
                return {"cache": None, "bindings": {}}
            try:
                bindings = self.storage_admin().table.stats()
            except Exception as exc:  # a broken binding must not take the metrics down
                bindings = {"problem": f"{type(exc).__name__}: {exc}"}
            return {"cache": tiered.stats(), "bindings": bindings}

        try:
            snap.update(await self.on_engine(engine_part, SNAPSHOT_TIMEOUT_S))
        except APIError as exc:
            snap["problem"] = exc.message
        return snap
