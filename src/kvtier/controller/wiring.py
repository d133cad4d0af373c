"""Wiring of a host pool and of stores into a cache's shared state, for building and for changes.

Owns ``open_stores`` (the stores a config names, with its defaults for each tier; raises when
one cannot be opened), ``open_guarded_stores`` (the same, fail-open: each behind a
``StoreGuard`` that keeps the tier off and retries instead), ``head_group_stores`` (a
tensor-parallel rank's views of them), ``warm_up_copies`` (the copy kernels run once at
build), and the two
binding functions that every path uses: ``TieredCache.build`` when it builds a cache, and the
admin operations (``kvtier.admin``) when they attach a store or rebuild the host pool on a live
one.

- ``bind_host_pool(ctx, pool, config)`` points every reader of the host pool at ``pool`` (None:
  host tier off): the context, the index's host allocator, a new copy engine, the IO workers
  (restarted on the new pool when they ran) and the write admission sized from it.
- ``bind_store(ctx, tier, store, config)`` puts ``store`` on ``tier``, starting the IO workers
  and the write admission when they do not run yet (a store only talks to the host tier, so a
  cache without one refuses it).

Engine thread only (building, or a change with the engine idle).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlsplit

from kvtier.config import KvtierConfig
from kvtier.controller.context import CacheContext
from kvtier.errors import ConfigError
from kvtier.index.residency import TIER_INDEX
from kvtier.layout import KVLayout
from kvtier.store.base import PageStore
from kvtier.units import redact_url

if TYPE_CHECKING:
    from kvtier.memory.host_pool import HostPool
    from kvtier.store.supervisor import GuardSettings

log = logging.getLogger(__name__)


def bind_host_pool(ctx: CacheContext, pool: HostPool | None, config: KvtierConfig) -> None:
    """Point the context, the index, the copy engine, the IO workers and the write admission at
    ``pool`` (or turn all of them off with None)."""
    from kvtier.controller.workers import IOWorkers
    from kvtier.memory.admission import WriteAdmission
    from kvtier.transfer import CopyEngine

    restart_workers = ctx.workers is not None
    if ctx.workers is not None:
        ctx.workers.close()
        ctx.workers = None
    ctx.host_pool = pool
    ctx.index.ledgers[TIER_INDEX["host"]].allocator = None if pool is None else pool.allocator
    if pool is None:
        ctx.copy = ctx.admission = None
        return
    host = config.host
    store_config = None
    if host.store_programs and ctx.device_pool.kv.device.type == "cuda":
        from kvtier.transfer.kernels import KernelConfig

        store_config = KernelConfig(max_programs=host.store_programs)
    ctx.copy = CopyEngine(ctx.device_pool, pool, path=host.copy_path,
                          staging_bytes=host.copy_staging_bytes, store_config=store_config,
                          layerwise_programs=host.load_programs)
    if restart_workers or ctx.stores:
        ctrl = config.controller
        ctx.workers = IOWorkers(pool, ctrl.io_workers, ctrl.io_queue_depth)
        ctx.admission = WriteAdmission.for_host_pool(pool.num_pages, host.prefetch_share)
    else:
        ctx.admission = None


def bind_store(ctx: CacheContext, tier: str, store: PageStore, config: KvtierConfig) -> None:
    """Serve ``tier`` from ``store``; start the IO workers and the write admission if needed."""
    from kvtier.controller.workers import IOWorkers
    from kvtier.memory.admission import WriteAdmission

    pool = ctx.host_pool
    if pool is None:
        raise ConfigError(f"store.{tier}", store.scheme, "a host tier (host.pool_bytes > 0): "
                          "stores exchange pages with the host tier only")
    if ctx.workers is None:
        ctrl = config.controller
        ctx.workers = IOWorkers(pool, ctrl.io_workers, ctrl.io_queue_depth)
    if ctx.admission is None:
        ctx.admission = WriteAdmission.for_host_pool(pool.num_pages, config.host.prefetch_share)
    ctx.stores[tier] = store


def open_stores(config: KvtierConfig, layout: KVLayout) -> dict[str, PageStore]:
    """The disk and remote stores ``config.store`` names, opened with the config's options for
    each (an option the URL's query sets itself wins). Raises what opening raises, after
    closing what it opened (an operator's attach wants the reason at once)."""
    out: dict[str, PageStore] = {}
    try:
        for tier, (_, opener) in store_openers(config, layout).items():
            out[tier] = opener()
    except BaseException:
        for opened in out.values():
            opened.close()
        raise
    return out


def open_guarded_stores(config: KvtierConfig, layout: KVLayout,
                        wrap: Callable[[PageStore], PageStore] | None = None,
                        page_bytes: int | None = None,
                        settings: GuardSettings | None = None) -> dict[str, PageStore]:
    """Fail-open ``open_stores``: each tier's store behind a ``StoreGuard``, which starts the
    tier off (and reopens it in the background) when its store cannot be opened. Only
    ``ConfigError`` (settings wrong in themselves) is raised. ``wrap`` (a rank's head-group
    view, of ``page_bytes`` pages) wraps each store the guard opens."""
    from kvtier.store.guard import StoreGuard

    out: dict[str, PageStore] = {}
    try:
        for tier, (url, opener) in store_openers(config, layout).items():
            scheme = urlsplit(url).scheme
            inner = opener if wrap is None else _wrapped(opener, wrap)
            out[tier] = StoreGuard.open(tier, inner, page_bytes=page_bytes or layout.page_bytes,
                                        scheme=scheme,
                                        url=redact_url(url), settings=settings)
    except BaseException:
        for opened in out.values():
            opened.close()
        raise
    return out


def store_openers(config: KvtierConfig,
                  layout: KVLayout) -> dict[str, tuple[str, Callable[[], PageStore]]]:
    """Per store tier the config names: its URL and how to open it with the config's options."""
    from kvtier.store import open_store

    out: dict[str, tuple[str, Callable[[], PageStore]]] = {}
    store = config.store
    if store.disk_url:
        options: dict[str, object] = {"max_bytes": store.disk_max_bytes}
        if urlsplit(store.disk_url).scheme == "file":
            options["min_free_bytes"] = store.disk_min_free_bytes
        out["disk"] = (store.disk_url, functools.partial(
            open_store, store.disk_url, page_bytes=layout.page_bytes,
            **_not_in_query(store.disk_url, options)))
    if store.remote_url:
        options = {"timeout_s": store.remote_timeout_s}
        if store.remote_ttl_s:
            options["ttl_s"] = store.remote_ttl_s
        if urlsplit(store.remote_url).scheme == "memory":
            options = {}
        out["remote"] = (store.remote_url, functools.partial(
            open_store, store.remote_url, page_bytes=layout.page_bytes,
            **_not_in_query(store.remote_url, options)))
    return out


def warm_up_copies(ctx: CacheContext) -> None:
    """At start, run the copy engine's copies once on a device page and a host page taken from
    the free pools and given back (``CopyEngine.warm_up``). A failure is logged and left to
    the first real copy, which fails open like any other."""
    if ctx.copy is None or ctx.host_pool is None:
        return
    taken: dict[str, list[int]] = {}
    try:
        for tier in ("device", "host"):
            taken[tier] = ctx.index.allocate(tier, 1)
        ctx.copy.warm_up(taken["device"][0], taken["host"][0])
    except Exception as exc:            # start-up goes on without it
        log.warning("kvtier: the copy kernels' warm-up failed (%s); they compile at first use",
                    exc)
    finally:
        for tier, ids in taken.items():
            ctx.index.free(tier, ids)


def head_group_stores(config: KvtierConfig, layout: KVLayout, heads: tuple[int, int],
                      heads_per_record: int, stores: dict[str, PageStore] | None, *,
                      open_config: bool) -> dict[str, PageStore]:
    """The rank's view (``HeadGroupStore``) of each shared store of head-group records (for
    stores opened from the config, inside their guard)."""
    from kvtier.store.head_groups import HeadGroupStore, check_heads

    record = check_heads(layout, heads, heads_per_record)  # before any store opens

    def view(store: PageStore) -> PageStore:
        return HeadGroupStore(store, layout, heads, heads_per_record)

    if stores is not None:
        return {tier: view(store) for tier, store in stores.items()}
    if not open_config:
        return {}
    return open_guarded_stores(config, record, wrap=view,
                               page_bytes=layout.for_heads(heads).page_bytes)


def _wrapped(opener: Callable[[], PageStore],
             wrap: Callable[[PageStore], PageStore]) -> Callable[[], PageStore]:
    def open_wrapped() -> PageStore:
        store = opener()
        try:
            return wrap(store)
        except BaseException:
            store.close()
            raise

    return open_wrapped


def _not_in_query(url: str, options: dict[str, object]) -> dict[str, object]:
    """Config values as store options, unless the URL's query sets them itself."""
    given = {name for name, _ in parse_qsl(urlsplit(url).query)}
    return {k: v for k, v in options.items() if k not in given}
