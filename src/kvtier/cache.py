"""``TieredCache``: the only object an engine sees (device -> host -> disk -> remote KV cache).

Owns the facade and its construction from ``KvtierConfig`` (pools, stores, workers, index,
controller). The engine's cycle for one prompt::

    hit = cache.match(tokens, salt)             # no mutation; hit.tokens, hit.tokens_by_tier
    r = cache.plan_split(hit)                   # head tokens to recompute instead of loading
    loaded = cache.load(hit, recompute_tokens=r)  # KV of [loaded.start_tokens, loaded.tokens)
                                                # on device pages loaded.device_page_ids, pinned
    new = cache.allocate(n_pages)               # device pages for the KV the engine computes
    cache.commit(tokens, page_ids, salt)        # every full page, in prefix order: loaded ids
                                                # where loaded, new ids elsewhere; ownership of
                                                # every id passes to the cache
    cache.release(loaded)                       # unpin
    cache.poll()                                # now and then: reap copies and IO completions

Pages are named by SHA-256 chain keys seeded by the namespace and the tenant salt, and indexed
by their tokens, so a request never hits another tenant's pages or a page computed for other
tokens. With several ranks (tensor parallel), pass ``collective`` (``min_across_ranks``) and
call ``match`` and ``load`` for the same requests in the same order on every rank; see
``kvtier.controller.ranks`` for the rule that keeps ranks from hanging.

Engine thread only (one thread calls every method); IO runs on worker threads inside.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from kvtier.config import KvtierConfig
from kvtier.controller.context import CacheContext
from kvtier.controller.controller import CacheController
from kvtier.controller.handles import Hit, Loaded
from kvtier.controller.ranks import Collective
from kvtier.controller.split import RateBook
from kvtier.errors import ConfigError
from kvtier.index.radix import RadixIndex
from kvtier.keys import KeyNamespace
from kvtier.layout import KVLayout
from kvtier.store.base import PageStore

__all__ = ["Hit", "Loaded", "TieredCache"]

CPU_DEVICE_POOL_CAP_BYTES = 1 << 30


class TieredCache:
    """See the module docstring. Build with ``TieredCache.build``."""

    def __init__(self, ctx: CacheContext, controller: CacheController, pinned_budget: Any = None) -> None:
        self.ctx = ctx
        self.controller = controller
        self.pinned_budget = pinned_budget
        self._closed = False

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def build(cls, config: KvtierConfig, layout: KVLayout, namespace: KeyNamespace, *,
              device: str = "cpu", collective: Collective | None = None,
              stores: dict[str, PageStore] | None = None) -> TieredCache:
        """Pools, stores, workers, index and controller from ``config``.

        ``stores`` (tier -> store) replaces the stores the config names (tests wrap stores in
        latency or fault injectors this way). ``cache.device_pages`` 0 sizes the device pool
        from free memory (``cache.device_memory_fraction``; on the CPU at most 1 GiB).
        """
        from kvtier.controller.workers import IOWorkers
        from kvtier.memory import HostPool, PinnedBudget, WriteAdmission
        from kvtier.memory.device_pool import DevicePool
        from kvtier.transfer import CopyEngine

        _check_page_sizes(config, layout, namespace)
        device_pool = _device_pool(DevicePool, config, layout, device)
        budget = PinnedBudget(config.host.pinned_budget_bytes)
        host_pool = None
        if config.host.pool_bytes >= layout.page_bytes:
            host_pool = HostPool.from_bytes(layout, config.host.pool_bytes, budget,
                                            host_layout=config.host.layout)
        opened = stores if stores is not None else _open_stores(config, layout) if host_pool else {}
        if host_pool is None:  # stores only talk to the host tier: without one they are unused
            for store in opened.values():
                store.close()
            opened = {}
        allocators = {"device": device_pool.allocator}
        if host_pool is not None:
            allocators["host"] = host_pool.allocator
        ctrl = config.controller
        ctx = CacheContext(
            index=RadixIndex(layout.page_size, allocators=allocators,
                             policies=config.cache.eviction_policy), namespace=namespace,
            config=ctrl, device_pool=device_pool, host_pool=host_pool,
            copy=CopyEngine(device_pool, host_pool, path=config.host.copy_path,
                            staging_bytes=config.host.copy_staging_bytes)
            if host_pool is not None else None,
            stores=dict(opened),
            rates=RateBook.for_device(device))
        if ctx.stores:
            ctx.workers = IOWorkers(host_pool, ctrl.io_workers, ctrl.io_queue_depth)
            ctx.admission = WriteAdmission.for_host_pool(host_pool.num_pages,
                                                         config.host.prefetch_share)
        controller = CacheController(ctx, prefetch_share=config.host.prefetch_share,
                                     collective=collective)
        return cls(ctx, controller, budget)

    # ---- what the engine uses ----------------------------------------------------------------
    @property
    def device_pool(self) -> Any:
        """The ``DevicePool``: ``.kv`` is ``[layers, parts, pages, page_size, kv_heads, head_dim]``."""
        return self.ctx.device_pool

    @property
    def page_size(self) -> int:
        return self.ctx.page_size

    def match(self, tokens: Any, salt: bytes | str | None = None) -> Hit:
        """The prompt's cached prefix on every tier (agreed across ranks). Changes nothing."""
        return self.controller.match(tokens, salt)

    def prefetch(self, hit: Hit, *, recompute_tokens: int = 0) -> None:
        """Optional: start landing the store part of ``hit`` (past ``recompute_tokens``) now,
        e.g. while the request is queued or while the engine recomputes the head."""
        self.controller.prefetch(hit, recompute_tokens)

    def load(self, hit: Hit, *, recompute_tokens: int = 0, overlap: bool = False) -> Loaded:
        """Bring the hit (past ``recompute_tokens``) to device pages and pin them. With
        ``overlap`` a copy from the host tier may still be in flight on return: read layer ``l``
        only after ``loaded.ticket.stream_wait(layer=l)`` (``loaded.ticket`` None: landed)."""
        return self.controller.load(hit, recompute_tokens, overlap=overlap)

    def plan_split(self, hit: Hit) -> int:
        """Tokens at the head of the hit to recompute rather than load (planner cost model)."""
        return self.controller.plan_split(hit)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Report a measured prefill (tokens in seconds): ``plan_split`` needs the rate."""
        self.controller.rates.observe_prefill(tokens, seconds)

    def allocate(self, n_pages: int) -> list[int]:
        """Device pages for new KV (evicting unpinned pages); ``PoolExhausted`` if impossible."""
        return self.controller.allocate(n_pages)

    def free(self, device_page_ids: Sequence[int]) -> None:
        """Give back allocated pages that will not be committed (an aborted request)."""
        self.controller.free(device_page_ids)

    def commit(self, tokens: Any, device_page_ids: Sequence[int],
               salt: bytes | str | None = None) -> None:
        """Index every full page of ``tokens`` (``device_page_ids[i]`` holds page i) and apply
        the write policy. The cache owns every id passed from now on."""
        self.controller.commit(tokens, device_page_ids, salt)

    def hint(self, tokens: Any, hint: Any, salt: bytes | str | None = None,
             tenant: str = "") -> Any:
        """Honour a request's cache hint (``kvtier.hints.CacheHint``) on its committed prefix:
        a bounded head start in eviction, never a pin; returns the ``HintOutcome``."""
        return self.controller.hint(tokens, hint, salt, tenant)

    def release(self, loaded_or_hit: Loaded | Hit) -> None:
        """Unpin what ``load`` pinned (idempotent)."""
        self.controller.release(loaded_or_hit)

    def flush(self) -> dict[str, int]:
        """Drop the device and host tiers (pinned pages stay; stores keep everything)."""
        return self.controller.flush()

    def poll(self) -> None:
        """Reap finished copies and IO jobs (call it from the engine loop now and then)."""
        self.controller.poll()

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait for every copy and IO job in flight; False if some are still running."""
        return self.controller.drain(timeout_s)

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if the index, the pools and the ledgers disagree."""
        self.controller.check_integrity()

    def stats(self) -> dict[str, Any]:
        from kvtier.controller.stats import cache_stats

        return cache_stats(self.ctx, self.controller, self.pinned_budget)

    def close(self) -> None:
        """Stop the workers (in-flight backups are cancelled) and close stores and pools."""
        if self._closed:
            return
        self._closed = True
        ctx = self.ctx
        self.controller.drain(timeout_s=1.0)
        if ctx.workers is not None:
            ctx.workers.close()
            self.controller.poll()
        for store in ctx.stores.values():
            store.close()
        if ctx.host_pool is not None:
            ctx.host_pool.close()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_page_sizes(config: KvtierConfig, layout: KVLayout, namespace: KeyNamespace) -> None:
    if not layout.page_size == namespace.page_size == config.cache.page_size:
        raise ConfigError("cache.page_size", config.cache.page_size,
                          f"the layout's ({layout.page_size}) and the namespace's "
                          f"({namespace.page_size}) page size")


def _device_pool(pool_cls: Any, config: KvtierConfig, layout: KVLayout, device: str) -> Any:
    pages = config.cache.device_pages
    if pages:
        return pool_cls(layout, pages, device)
    if str(device).startswith("cuda"):
        return pool_cls.from_free_memory(layout, config.cache.device_memory_fraction, device)
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    budget = min(int(available * config.cache.device_memory_fraction), CPU_DEVICE_POOL_CAP_BYTES)
    return pool_cls(layout, max(1, budget // layout.page_bytes), device)


def _open_stores(config: KvtierConfig, layout: KVLayout) -> dict[str, PageStore]:
    from kvtier.store import open_store

    out: dict[str, PageStore] = {}
    store = config.store
    if store.disk_url:
        options = {"max_bytes": store.disk_max_bytes}
        if urlsplit(store.disk_url).scheme == "file":
            options["min_free_bytes"] = store.disk_min_free_bytes
        out["disk"] = open_store(store.disk_url, page_bytes=layout.page_bytes,
                                 **_not_in_query(store.disk_url, options))
    if store.remote_url:
        options = {"timeout_s": store.remote_timeout_s}
        if store.remote_ttl_s:
            options["ttl_s"] = store.remote_ttl_s
        if urlsplit(store.remote_url).scheme == "memory":
            options = {}
        try:
            out["remote"] = open_store(store.remote_url, page_bytes=layout.page_bytes,
                                       **_not_in_query(store.remote_url, options))
        except BaseException:
            for opened in out.values():
                opened.close()
            raise
    return out


def _not_in_query(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """Config values as store options, unless the URL's query sets them itself."""
    given = {name for name, _ in parse_qsl(urlsplit(url).query)}
    return {k: v for k, v in options.items() if k not in given}
