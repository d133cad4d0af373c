"""``TieredCache``: the only object an engine sees (device -> host -> disk -> remote KV cache).

Owns the facade and its construction from ``KvtierConfig`` (pools, stores, workers, index,
controller). The engine's cycle for one prompt::

    hit = cache.match(tokens, salt)             # no mutation; hit.tokens, hit.tokens_by_tier
    r = cache.plan_split(hit)                   # head tokens to recompute instead of loading
    loaded = cache.load(hit, recompute_tokens=r)  # KV of [loaded.start_tokens, loaded.tokens)
                                                # on device pages loaded.device_page_ids, pinned
    new = cache.allocate(n_pages)               # device pages for the KV the engine computes
    cache.commit(tokens, page_ids, salt, loaded=loaded)  # every full page, in prefix
                                                # order: loaded ids where loaded, new ids
                                                # elsewhere; ownership of every id passes to
                                                # the cache (``loaded``: reuse the walk)
    cache.release(loaded)                       # unpin
    cache.poll()                                # now and then: reap copies and IO completions

An engine that moves KV between its own memory and host pages itself (the vLLM connector's
direct path) uses the host tier without device pages of kvtier's::

    held = cache.hold_host(hit)                 # host pages of the hit's prefix, pinned
    ...copy held.host_page_ids into the engine's memory; held.ticket = its copy's ticket
    cache.release(held)
    cache.save_host(tokens, fill, salt)         # fill(first, host_ids) writes those pages

Pages are named by SHA-256 chain keys seeded by the namespace and the tenant salt, and indexed
by their tokens, so a request never hits another tenant's pages or a page computed for other
tokens. With several ranks (tensor parallel), pass ``collective`` (``min_across_ranks``) and
call ``match`` and ``load`` for the same requests in the same order on every rank; see
``kvtier.controller.ranks`` for the rule that keeps ranks from hanging.

Engine thread only (one thread calls every method); IO runs on worker threads inside.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.config import KvtierConfig, setting_name
from kvtier.controller.close_flush import flush_to_stores, tell_flush
from kvtier.controller.context import CacheContext
from kvtier.controller.controller import CacheController
from kvtier.controller.handles import Held, Hit, Loaded
from kvtier.controller.ranks import Collective
from kvtier.controller.rates import RateBook
from kvtier.controller.wiring import (
    bind_host_pool,
    head_group_stores,
    open_guarded_stores,
    warm_up_copies,
)
from kvtier.errors import ConfigError, LayoutMismatch
from kvtier.index.radix import RadixIndex
from kvtier.keys import KeyNamespace, Tokens
from kvtier.layout import KVLayout
from kvtier.store.base import PageStore

if TYPE_CHECKING:
    from kvtier.controller.hints import HintOutcome
    from kvtier.controller.writes import HostFill
    from kvtier.hints import CacheHint
    from kvtier.memory.device_pool import DevicePool
    from kvtier.memory.host_pool import HostPool
    from kvtier.memory.pinned import PinnedBudget

__all__ = ["Hit", "Loaded", "TieredCache"]


STORE_TIERS = ("disk", "remote")


class TieredCache:
    """See the module docstring. Build with ``TieredCache.build``."""

    def __init__(self, ctx: CacheContext, controller: CacheController,
                 pinned_budget: PinnedBudget | None = None) -> None:
        self.ctx = ctx
        self.controller = controller
        self.pinned_budget: PinnedBudget | None = pinned_budget
        self._closed = False

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def build(cls, config: KvtierConfig, layout: KVLayout, namespace: KeyNamespace, *,
              device: str = "cpu", collective: Collective | None = None,
              stores: dict[str, PageStore] | None = None, heads: tuple[int, int] | None = None,
              heads_per_record: int = 1, device_pool: DevicePool | None = None,
              pin_host: bool | None = None) -> TieredCache:
        """Pools, stores, workers, index and controller from ``config``.

        ``heads`` (a tensor-parallel rank's KV heads of ``layout``, the full model's layout)
        builds the cache of that share: pools of ``layout.for_heads(heads)``, and every store
        (opened from the config or given in ``stores``) seen through a ``HeadGroupStore`` of
        ``heads_per_record`` heads a record, so ranks of any TP size share pages. ``namespace``
        is the full model's, the same on every rank.

        Stores opened from the config fail open: each sits behind a ``StoreGuard``, so a store
        that cannot be opened (unreachable, a damaged or foreign directory) leaves its tier off,
        said in the log and ``health``, and is opened again in the background; only settings
        wrong in themselves raise ``ConfigError``.
        ``stores`` (tier -> store) replaces the stores the config names (tests wrap stores in
        latency or fault injectors this way). Store tiers without a host pool, and a host pool
        smaller than one page, are refused (``ConfigError`` naming the settings).
        ``device_pool`` (pages in memory the caller allocated, ``DevicePool.over``) replaces
        the pool ``cache.device_pages`` would make; ``pin_host`` False keeps the host tier
        in pageable memory (None: pinned when CUDA is present), for a cache whose pages never
        cross to a GPU from this process. ``cache.device_pages`` 0 sizes the
        device pool from free memory (``cache.device_memory_fraction``; on the CPU at most
        1 GiB).
        """
        from kvtier.memory import HostPool, PinnedBudget
        from kvtier.memory.device_pool import DevicePool

        _check_page_sizes(config, layout, namespace)
        model_layout = layout
        if heads is not None:
            layout = model_layout.for_heads(heads)
        _check_host_tier(config, layout, stores)
        if device_pool is None:
            device_pool = DevicePool.from_config(config.cache, layout, device)
        elif device_pool.layout != layout:
            raise LayoutMismatch(f"a device pool of {device_pool.layout} for layout {layout}")
        budget = PinnedBudget(config.host.pinned_budget_bytes)
        host_pool = None
        if config.host.pool_bytes:
            host_pool = HostPool.from_bytes(layout, config.host.pool_bytes, budget,
                                            host_layout=config.host.layout, pin=pin_host)
        if heads is None:
            opened = stores if stores is not None else (
                open_guarded_stores(config, layout) if host_pool else {})
        else:
            opened = head_group_stores(config, model_layout, heads, heads_per_record, stores,
                                        open_config=host_pool is not None)
        ctx = CacheContext(
            index=RadixIndex(layout.page_size, allocators={"device": device_pool.allocator},
                             policies=config.cache.eviction_policy), namespace=namespace,
            config=config.controller, device_pool=device_pool, rates=RateBook.for_device(device))
        for tier, store in opened.items():
            ctx.stores[tier] = store
        bind_host_pool(ctx, host_pool, config)
        controller = CacheController(ctx, prefetch_share=config.host.prefetch_share,
                                     collective=collective)
        if device_pool.kv.device.type == "cuda":
            warm_up_copies(ctx)
        return cls(ctx, controller, budget)

    # ---- what the engine uses ----------------------------------------------------------------
    @property
    def device_pool(self) -> DevicePool:
        """The ``DevicePool``: ``.kv`` is ``[layers, parts, pages, page_size, kv_heads, head_dim]``."""
        return self.ctx.device_pool

    @property
    def host_pool(self) -> HostPool | None:
        """The host tier's ``HostPool`` (None: host tier off); to read, not to change."""
        return self.ctx.host_pool

    def store(self, tier: str) -> PageStore | None:
        """The store serving ``tier`` (``disk`` or ``remote``) now; None while the tier is off.
        To read (``stats()``), not to change: stores attach and detach through ``kvtier.admin``."""
        if tier not in STORE_TIERS:
            raise ValueError(f"store tier must be one of {', '.join(STORE_TIERS)}, got {tier!r}")
        return self.ctx.stores.get(tier)

    @property
    def page_size(self) -> int:
        return self.ctx.page_size

    def match(self, tokens: Tokens, salt: bytes | str | None = None) -> Hit:
        """The prompt's cached prefix on every tier (agreed across ranks). Changes nothing; the
        hit carries this walk of the index, which ``load`` reuses while the index is unchanged."""
        return self.controller.lookup.match(tokens, salt)

    def prefetch(self, hit: Hit, *, recompute_tokens: int = 0) -> None:
        """Optional: start landing the store part of ``hit`` (past ``recompute_tokens``) now,
        e.g. while the request is queued or while the engine recomputes the head."""
        self.controller.prefetch(hit, recompute_tokens)

    def landing(self, hit: Hit) -> bool:
        """After ``prefetch(hit)``: whether its store part is still landing, so that ``load``
        now would wait for it. A caller that must not block (a scheduler serving other
        requests) asks again later and loads once this is False; the load then serves what
        landed within the prefetch policy's wait."""
        return self.controller.landing(hit)

    def load(self, hit: Hit, *, recompute_tokens: int = 0, overlap: bool = False,
             layerwise: bool = True) -> Loaded:
        """Bring the hit (past ``recompute_tokens``) to device pages and pin them. With
        ``overlap`` a copy from the host tier may still be in flight on return: read layer ``l``
        only after ``loaded.ticket.stream_wait(layer=l)`` (``loaded.ticket`` None: landed); it
        lands layer by layer, or with ``layerwise=False`` all at once as one faster copy."""
        self.controller.poll()
        return self.controller.loader.load(hit, recompute_tokens, overlap=overlap,
                                           layerwise=layerwise)

    def hold_host(self, hit: Hit) -> Held:
        """Pin the host tier's prefix of ``hit`` for a caller that copies host pages into its
        own memory itself (``held.host_page_ids``, prompt pages ``[0, held.pages)``). The part
        only stores hold lands in the host tier first, under the prefetch policy, as for
        ``load``. Set ``held.ticket`` to the copy reading them, then ``release(held)``."""
        self.controller.poll()
        return self.controller.hold(hit)

    def save_host(self, tokens: Tokens, fill: HostFill, salt: bytes | str | None = None) -> int:
        """Store the full pages of ``tokens`` the host tier lacks without device pages of
        kvtier's: ``fill(first, host_ids)`` starts writing prompt pages ``[first, first +
        len(host_ids))`` (kvtier's page layout) into those host pages and returns a ticket
        (``is_done()``, ``wait(timeout_s)``); they enter the index when it is done, then go to
        the stores as any host page does. Returns the prompt's pages the host tier holds or
        will hold (0: no room). Needs a host tier."""
        return self.controller.fill_host(tokens, fill, salt)

    def plan_split(self, hit: Hit) -> int:
        """Tokens at the head of the hit to recompute rather than load (planner cost model)."""
        return self.controller.plan_split(hit)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Report a measured prefill (tokens in seconds): ``plan_split`` needs the rate."""
        self.controller.rates.observe_prefill(tokens, seconds)

    def observe_split(self, hit_tokens: int, predicted_s: float, seconds: float) -> None:
        """Report how long a split (``plan_split``'s answer) took to its first token."""
        self.controller.rates.observe_split(hit_tokens, predicted_s, seconds)

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        """Report a measured load of ``nbytes`` from a store tier: the split's fixed costs."""
        self.controller.rates.observe_load(tier, nbytes, seconds)

    @property
    def pending_split(self) -> tuple[int, float] | None:
        """(hit tokens, predicted seconds) of the split ``plan_split`` chose last, if any."""
        return self.controller.rates.pending_split

    def device_prefix(self, tokens: Tokens, salt: bytes | str | None = None) -> list[int]:
        """Device page ids of the longest prefix of ``tokens`` the device tier holds now."""
        match = self.ctx.index.match(tokens, salt)
        return match.ids("device", 0, match.depth_of("device"))

    def clear_tier(self, tier: str) -> None:
        """Forget what one tier (``device`` or ``host``) holds; pinned pages stay."""
        self.ctx.index.clear(tier)

    @property
    def index(self) -> RadixIndex:
        """The radix index, for observers of its moves (KV events); change it only through
        this facade."""
        return self.ctx.index

    def allocate(self, n_pages: int) -> list[int]:
        """Device pages for new KV (evicting unpinned pages, and reaping finished host copies,
        which lock theirs until reaped); ``PoolExhausted`` if impossible."""
        return self.controller.allocate(n_pages)

    def free(self, device_page_ids: Sequence[int]) -> None:
        """Give back allocated pages that will not be committed (an aborted request)."""
        self.controller.free(device_page_ids)

    def commit(self, tokens: Tokens, device_page_ids: Sequence[int],
               salt: bytes | str | None = None, *, loaded: Loaded | None = None) -> None:
        """Index every full page of ``tokens`` (``device_page_ids[i]`` holds page i) and apply
        the write policy. The cache owns every id passed from now on. ``loaded`` (what
        ``load`` returned for this request, released or not) lets the commit continue the
        request's walk of the index instead of walking it again."""
        self.controller.commit(tokens, device_page_ids, salt, loaded)

    def commit_tail(self, tokens: Tokens, device_page_ids: Sequence[int], first: int,
                    salt: bytes | str | None = None) -> int:
        """Store full pages ``[first, ...)`` of ``tokens`` on the host tier only, which must
        hold pages ``[0, first)`` (``device_page_ids[i]``, from ``allocate``, holds page
        ``first + i``; the cache owns them from now on). Returns the pages stored; 0 when the
        host tier lost the head meanwhile (then nothing is stored). Needs ``tail_commits``."""
        return self.controller.commit_tail(tokens, device_page_ids, first, salt)

    def host_pages(self, hit: Hit) -> int:
        """Pages of ``hit``'s prompt the host tier holds from the root (this rank)."""
        return self.controller.host_pages(hit)

    @property
    def tail_commits(self) -> bool:
        """Whether ``commit_tail`` applies (a host tier under ``write_through``)."""
        return self.controller.tail_commits

    def hint(self, tokens: Tokens, hint: CacheHint, salt: bytes | str | None = None,
             tenant: str = "") -> HintOutcome:
        """Honour a request's cache hint (``kvtier.hints.CacheHint``) on its committed prefix:
        a bounded head start in eviction, never a pin; returns the ``HintOutcome``."""
        return self.controller.hint(tokens, hint, salt, tenant)

    def release(self, loaded_or_hit: Loaded | Hit | Held) -> None:
        """Unpin what ``load`` or ``hold_host`` pinned (idempotent)."""
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

    def stats(self) -> dict[str, object]:
        from kvtier.controller.stats import cache_stats

        return cache_stats(self.ctx, self.controller, self.pinned_budget)

    def store_health(self) -> dict[str, dict[str, object]]:
        """Per store tier opened from the config: ``state`` (on, degraded, off), ``problems``
        (reason -> message), ``retry_in_s`` while off, event counts. Any thread."""
        from kvtier.controller.stats import store_health

        return store_health(self.ctx)

    def close(self) -> None:
        """Under ``write_back``, back up to the stores what only memory holds (at most
        ``controller.close_flush_s``, see ``kvtier.controller.close_flush``); then stop the workers
        (in-flight backups are cancelled) and close stores and pools."""
        if self._closed:
            return
        self._closed = True
        ctx = self.ctx
        controller = self.controller
        flushed = flush_to_stores(ctx, controller.writer, lambda s: controller.drain(timeout_s=s),
                                  ctx.config.close_flush_s)
        self.controller.drain(timeout_s=1.0)
        if ctx.workers is not None:
            ctx.workers.close()
            self.controller.poll()
        if flushed is not None:
            tell_flush(ctx, flushed)
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


def _check_host_tier(config: KvtierConfig, layout: KVLayout,
                     stores: dict[str, PageStore] | None) -> None:
    """Refuse a host pool too small for one page, and store tiers without a host tier (stores
    exchange pages with the host tier only), naming the settings."""
    pool_bytes = config.host.pool_bytes
    if 0 < pool_bytes < layout.page_bytes:
        raise ConfigError(setting_name("host.pool_bytes"), pool_bytes,
                          f"0 (host tier off) or at least one page of {layout.page_bytes} bytes")
    named = [setting_name(p) for p, url in (("store.disk_url", config.store.disk_url),
                                            ("store.remote_url", config.store.remote_url)) if url]
    if pool_bytes == 0 and (named or stores):
        tiers = " and ".join(named) or "the stores given"
        raise ConfigError(setting_name("host.pool_bytes"), 0,
                          f"a host pool while {tiers} is set: stores exchange pages with the "
                          "host tier only (give the host pool bytes, or drop the store tier)")
