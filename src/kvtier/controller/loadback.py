"""Load-back: bring a hit to device pages before the request runs (store -> host -> device).

Owns ``LoadBack.load``, the one path by which a hit becomes device pages, and ``LoadBack.hold``,
its host-only twin for an engine that reads host pages itself (steps 1, 2 and the landing of
step 4, then the host prefix pinned; one rank only):

1. take the hit's walk of the index (walking again only if the index changed since ``match``),
   count the use, lock the device prefix and the host prefix that serve as sources;
2. prefetch the part only stores hold (``Prefetcher``; waits as the prefetch policy says);
3. agree across ranks on the pages available (collective 1);
4. allocate device pages (evicting device leaves), copy host -> device through the copy engine
   and wait for it, put landed pages into the host tier and loaded pages into the device tier;
5. agree across ranks on the pages loaded (collective 2), pin the agreed prefix on device.

When the engine recomputes the head of the hit (``recompute_tokens`` past the device prefix),
only the tail beyond it is loaded, into device pages private to the returned ``Loaded`` (the
device tier must stay prefix-closed, so they enter the index when the engine commits them).

With ``overlap`` a hit served from the host tier alone is copied and not waited for: the
returned ``Loaded`` carries the ``Ticket`` (the model's forward waits on the device for each
layer as it reaches it), per layer by default or, with ``layerwise=False``, one copy of every
layer (for a consumer that will wait for all of it at once, where one large copy is faster) and
keeps the host pages it copies from locked until ``release``, which first waits for the copy. A
hit with pages landed from a store is still waited for here (its landed host pages are not
locked), and so is everything on the CPU.

Steps 1, 2 and 4 never raise out of ``load``: a failure there makes this rank contribute 0 pages
to the next collective (and is counted), so every rank always makes both calls (see
``kvtier.controller.ranks``). Engine thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from kvtier.controller.context import CacheContext
from kvtier.controller.handles import Held, Hit, Loaded
from kvtier.controller.prefetch import Prefetcher, PrefetchTask
from kvtier.controller.ranks import RankAgreement
from kvtier.controller.writes import HostWriter
from kvtier.errors import PoolExhausted
from kvtier.index.match import IndexMatch
from kvtier.index.residency import Node
from kvtier.keys import PageKey

if TYPE_CHECKING:
    from kvtier.transfer.copy_engine import Ticket

T = TypeVar("T")


@dataclass
class LoadPlan:
    """This rank's view of one load, built in step 1 and 2."""

    data: bytes
    salt: bytes
    keys: list[PageKey] = field(default_factory=list)
    device: int = 0               # device depth (pages) when the load began
    host: int = 0                 # host depth
    begin: int = 0                # first page to bring to device
    prefix_mode: bool = True      # begin == device: loaded pages extend the device prefix
    store_lo: int = 0             # first page the prefetch covers
    task: PrefetchTask | None = None
    landed_ids: list[int] = field(default_factory=list)
    available: int = 0            # pages this rank could put on device
    overlap: bool = False         # leave the copy in flight (host pages only)
    layerwise: bool = True        # with overlap: one launch per layer, else one for all
    ticket: Ticket | None = None  # the copy left in flight
    match: IndexMatch | None = None   # the latest walk (reused while the index is unchanged)
    device_lock: Node | None = None
    host_lock: Node | None = None


class LoadBack:
    """Runs loads; see the module docstring."""

    def __init__(self, ctx: CacheContext, prefetcher: Prefetcher, writer: HostWriter,
                 ranks: RankAgreement, private_owner: dict[int, Loaded] | None = None) -> None:
        self.ctx = ctx
        #: The controller's ledger of device pages private to a ``Loaded`` (filled here).
        self.private_owner: dict[int, Loaded] = {} if private_owner is None else private_owner
        self.prefetcher = prefetcher
        self.writer = writer
        self.ranks = ranks

    def load(self, hit: Hit, recompute_tokens: int = 0, *, overlap: bool = False,
             layerwise: bool = True) -> Loaded:
        plan = LoadPlan(hit._data, hit.salt, overlap=overlap, layerwise=layerwise)
        ok = self._guard(lambda: self._prepare(plan, hit, recompute_tokens))
        agreed = self.ranks.agree(plan.available if ok else 0)
        result = self._guard(lambda: self._to_device(plan, agreed)) if ok else None
        end, private = result if result else (0, [])
        final = self.ranks.agree(end)
        loaded = self._finish(hit, plan, min(final, end), private)
        for page_id in loaded._private:
            self.private_owner[page_id] = loaded
        return loaded

    def hold(self, hit: Hit) -> Held:
        """Pin the host tier's prefix of ``hit``, with the part only stores hold landed in it
        first (under the prefetch policy, like ``load``); nothing goes to device. A failure
        is counted and holds nothing."""
        ctx = self.ctx
        plan = LoadPlan(hit._data, hit.salt)
        held = Held(0, [], hit)
        try:
            if self._guard(lambda: self._prepare(plan, hit, 0)):
                self._keep_landed(plan)
                match = self._walk(plan)
                end = min(match.depth_of("host"), hit.pages, match.prompt_pages)
                node, plan.match = ctx.lock_on(match, end, "host")
                held = Held(end * ctx.page_size, plan.match.ids("host", 0, end), hit, node)
        finally:
            ctx.unlock(plan.device_lock, "device")
            ctx.unlock(plan.host_lock, "host")
        ctx.count("hold_total")
        ctx.count("held_tokens_total", held.tokens)
        if plan.keys and held.tokens:
            self.writer.after_load(plan.data, plan.salt, plan.keys, self._walk(plan))
        return held

    def _guard(self, step: Callable[[], T]) -> T | None:
        try:
            return step()
        except Exception:
            self.ctx.count("load_errors_total")
            return None

    # ---- step 1 and 2 --------------------------------------------------------------------
    def _prepare(self, plan: LoadPlan, hit: Hit, recompute_tokens: int) -> bool:
        ctx = self.ctx
        match = (ctx.index.match(plan.data, plan.salt) if hit._match is None
                 else ctx.index.current(hit._match))
        ctx.index.touch(match)
        target = min(hit.pages, match.prompt_pages)
        plan.device = min(match.depth_of("device"), target)
        plan.host = min(match.depth_of("host"), target)
        head = min(max(recompute_tokens, 0) // ctx.page_size, target)
        plan.begin = plan.device if head <= plan.device else head
        plan.prefix_mode = plan.begin == plan.device
        plan.keys = ctx.keys(match, target)
        if plan.prefix_mode:
            plan.device_lock, match = ctx.lock_on(match, plan.device, "device")
        plan.host_lock, plan.match = ctx.lock_on(match, plan.host, "host")
        plan.store_lo = plan.available = max(plan.begin, plan.host)
        store_hi = min(target, max(hit._store_ends))
        if hit.reach("remote") > hit.reach("host") and plan.store_lo < store_hi \
                and ctx.workers is not None:
            self._prefetch(plan, hit, store_hi)
        return True

    def _prefetch(self, plan: LoadPlan, hit: Hit, store_hi: int) -> None:
        task, hit._prefetch = getattr(hit, "_prefetch", None), None
        if task is None or task.lo != plan.store_lo or task.job.cancelled:
            if task is not None:
                task.job.cancel()
                self.prefetcher.unhold(task)
            task = self.prefetcher.start(plan.data, plan.salt, plan.keys, plan.store_lo, store_hi,
                                         hit._store_ends[0])
        if task is None:
            return
        plan.task = task
        landed = self.prefetcher.wait(task)
        plan.landed_ids = self.prefetcher.take(task, landed)
        plan.available = plan.store_lo + len(plan.landed_ids)
        if task.held:
            self.prefetcher.unhold(task)

    # ---- step 4 ----------------------------------------------------------------------------
    def _to_device(self, plan: LoadPlan, agreed: int) -> tuple[int, list[int]]:
        ctx = self.ctx
        end = min(agreed, plan.available)
        if end <= plan.begin:
            return (end if plan.prefix_mode else 0), []
        try:
            device_ids = ctx.index.allocate("device", end - plan.begin)
        except PoolExhausted:
            ctx.count("load_device_full_total")
            return (min(plan.device, end) if plan.prefix_mode else 0), []
        match = self._walk(plan)
        host_end = min(plan.host, end)
        sources = match.ids("host", plan.begin, host_end) if host_end > plan.begin else []
        sources += plan.landed_ids[:max(0, end - plan.store_lo)]
        copy = ctx.copy
        assert copy is not None, "a load from the host tier without a copy engine"
        if plan.overlap and not plan.landed_ids and copy.asynchronous:
            plan.ticket = (copy.load_layerwise(sources, device_ids) if plan.layerwise
                           else copy.load(sources, device_ids))
        else:
            started = time.monotonic()
            copy.load(sources, device_ids).wait(None)
            if ctx.rates is not None:
                ctx.rates.observe("host", len(device_ids) * ctx.device_pool.layout.page_bytes,
                                  time.monotonic() - started)
        ctx.count("load_back_pages_total", len(device_ids))
        self._keep_landed(plan)
        if not plan.prefix_mode:
            return end, device_ids
        result = ctx.index.insert(plan.data, plan.keys, tier="device", ids=device_ids,
                                  start=plan.begin, stop=end, salt=plan.salt, strict=False,
                                  after=self._walk(plan))
        plan.match = result.match
        ctx.index.free("device", result.unused_ids)
        return plan.begin + result.taken, []

    def _keep_landed(self, plan: LoadPlan) -> None:
        """Landed pages enter the host tier (where it stays prefix-closed) or go back."""
        if plan.landed_ids and plan.task is not None:
            ids, plan.landed_ids = plan.landed_ids, []
            _, plan.match = self.prefetcher.insert_landed(plan.task, 0, ids,
                                                          after=self._walk(plan))

    # ---- step 5 ----------------------------------------------------------------------------
    def _finish(self, hit: Hit, plan: LoadPlan, end: int, private: list[int]) -> Loaded:
        ctx = self.ctx
        try:
            self._keep_landed(plan)
            if plan.prefix_mode:
                node, plan.match = ctx.lock_on(self._walk(plan), end, "device")
                ids = plan.match.ids("device", 0, end)
                loaded = Loaded(end * ctx.page_size, ids, 0, hit, node)
            else:
                keep = private[:max(0, end - plan.begin)]
                ctx.index.free("device", private[len(keep):])
                start = plan.begin * ctx.page_size if keep else 0
                loaded = Loaded((plan.begin + len(keep)) * ctx.page_size if keep else 0, keep,
                                start, hit, None, set(keep))
            if plan.ticket is not None:  # the copy still reads these host pages
                loaded.ticket, loaded._host_lock_node = plan.ticket, plan.host_lock
                plan.host_lock = None
        finally:
            ctx.unlock(plan.device_lock, "device")
            ctx.unlock(plan.host_lock, "host")
        ctx.count("load_total")
        ctx.count("loaded_tokens_total", loaded.tokens - loaded.start_tokens)
        if plan.keys:
            self.writer.after_load(plan.data, plan.salt, plan.keys, plan.match)
        loaded._match = plan.match  # commit re-walks it if the write policy changed the tree
        return loaded

    def _walk(self, plan: LoadPlan) -> IndexMatch:
        """The plan's walk, renewed only if the index changed since."""
        plan.match = (self.ctx.index.match(plan.data, plan.salt) if plan.match is None
                      else self.ctx.index.current(plan.match))
        return plan.match
