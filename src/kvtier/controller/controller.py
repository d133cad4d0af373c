"""The cache controller: bookkeeping on the engine thread, bytes in workers and the copy engine.

Owns ``CacheController``, which ties the index to the pools, the stores and the IO workers and
builds the parts ``TieredCache`` calls directly (``lookup`` for match, ``loader`` for load), and
implements the rest: commit under the write policy (``HostWriter``, ``Backups``), allocation,
release, flush, poll and stats. It also keeps the ownership ledger of device pages that are not
in the index: pages handed to the engine by ``allocate`` and pages private to a ``Loaded``; a
``commit`` transfers them to the index (or frees duplicates), ``release`` frees what a
``Loaded`` still holds. ``check_integrity`` verifies the index and these ledgers together.

Every public method runs on the engine thread. IO workers only run jobs and post completions,
which ``poll`` reaps here (the facade polls before each load, ``flush`` and ``drain`` too).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvtier.controller.backups import Backups
from kvtier.controller.context import CacheContext
from kvtier.controller.handles import Held, Hit, Loaded
from kvtier.controller.hints import HintBook, HintOutcome
from kvtier.controller.jobs import PrefetchJob
from kvtier.controller.loadback import LoadBack
from kvtier.controller.lookup import Lookup
from kvtier.controller.prefetch import Prefetcher
from kvtier.controller.ranks import Collective, RankAgreement
from kvtier.controller.rates import RateBook
from kvtier.controller.split import plan_split
from kvtier.controller.writes import HostFill, HostWriter
from kvtier.errors import PoolExhausted
from kvtier.hints import CacheHint
from kvtier.index.radix import as_token_bytes, salt_bytes
from kvtier.keys import Tokens


class CacheController:
    """See the module docstring."""

    def __init__(self, ctx: CacheContext, *, prefetch_share: float = 0.5,
                 collective: Collective | None = None, rates: RateBook | None = None) -> None:
        self.ctx = ctx
        self.ranks = RankAgreement(collective)
        self.rates = ctx.rates = rates or ctx.rates or RateBook()
        self.backups = Backups(ctx)
        self.writer = HostWriter(ctx, self.backups)
        self.prefetcher = Prefetcher(ctx, prefetch_share)
        self.lookup = Lookup(ctx, self.ranks)
        self.engine_pages: set[int] = set()
        self.private_owner: dict[int, Loaded] = {}
        self.loader = LoadBack(ctx, self.prefetcher, self.writer, self.ranks, self.private_owner)
        ctx.index.on_evict = self.writer.on_evict
        self.hints = HintBook(ctx.index, ctx.config.hint_share, ctx.count)
        self._store_epochs = {tier: store.epoch for tier, store in ctx.stores.items()}

    # ---- requests ------------------------------------------------------------------------
    def prefetch(self, hit: Hit, recompute_tokens: int = 0) -> None:
        """Start the store part of ``hit`` past ``recompute_tokens`` landing now (``load`` with
        the same ``recompute_tokens`` waits for it later)."""
        ctx = self.ctx
        if hit.reach("remote") <= hit.reach("host") or ctx.workers is None:
            return
        match = (ctx.index.match(hit._data, hit.salt) if hit._match is None
                 else ctx.index.current(hit._match))
        head = max(recompute_tokens, 0) // ctx.page_size
        lo = max(match.depth_of("device"), match.depth_of("host"), head)
        hi = min(hit.pages, max(hit._store_ends))
        if lo < hi and hit._prefetch is None:
            keys = ctx.keys(match, hi)
            task = self.prefetcher.start(hit._data, hit.salt, keys, lo, hi, hit._store_ends[0])
            if task is not None:
                task.held = True
                hit._prefetch = task

    def landing(self, hit: Hit) -> bool:
        """Whether the prefetch ``prefetch`` started for ``hit`` is still landing, so that a
        load now would wait for it (under the prefetch policy)."""
        task = hit._prefetch
        return task is not None and self.prefetcher.waiting(task)

    def plan_split(self, hit: Hit) -> int:
        """Agreed across ranks (rates are measured per rank): the smallest rank's split."""
        return self.ranks.agree(lambda: plan_split(hit, self.rates, self._bytes_per_token()))

    def _bytes_per_token(self) -> int:
        layout = self.ctx.device_pool.layout
        return layout.page_bytes // layout.page_size

    def allocate(self, n_pages: int) -> list[int]:
        try:
            ids = self.ctx.index.allocate("device", n_pages)
        except PoolExhausted:   # host copies that finished still lock their pages until reaped
            self.poll()
            ids = self.ctx.index.allocate("device", n_pages)
        self.engine_pages.update(ids)
        return ids

    def free(self, device_page_ids: Sequence[int]) -> None:
        """Give back pages from ``allocate`` that will not be committed."""
        ids = [i for i in device_page_ids if i in self.engine_pages]
        self.engine_pages.difference_update(ids)
        self.ctx.index.free("device", ids)

    def commit(self, tokens: Tokens, device_page_ids: Sequence[int],
               salt: bytes | str | None = None, loaded: Loaded | None = None) -> None:
        """Insert every full page of ``tokens`` on device; ownership of every id passed moves
        to the cache (ids of pages it already holds are freed), then the write policy runs.
        ``loaded`` (the request's load): continue its walk of the tree instead of walking."""
        ctx = self.ctx
        data, key = as_token_bytes(tokens), salt_bytes(salt)
        full = len(data) // ctx.step
        ids = [int(i) for i in device_page_ids]
        walked = loaded._match if loaded is not None else None
        match = ctx.index.match(data, key) if walked is None else ctx.index.extend(walked, data, key)
        self._check_ownership(ids, full, match.ids("device", 0, min(match.depth_of("device"),
                                                                       full)))
        for page_id in ids:
            self.engine_pages.discard(page_id)
            owner = self.private_owner.pop(page_id, None)
            if owner is not None:
                owner._private.discard(page_id)
        keys = ctx.keys(match, full)
        result = ctx.index.insert(data, keys, tier="device", ids=ids[:full], salt=key, after=match)
        held = set(match.ids("device", 0, min(match.depth_of("device"), full)))
        ctx.index.free("device", result.unused_ids + [i for i in ids[full:] if i not in held])
        ctx.count("commit_total")
        ctx.count("commit_new_pages_total", result.taken)
        self.hints.observe(result.taken, time.monotonic())
        self.writer.after_commit(data, key, keys, result.match)

    def commit_tail(self, tokens: Tokens, device_page_ids: Sequence[int], first: int,
                    salt: bytes | str | None = None) -> int:
        """Store full pages ``[first, ...)`` of ``tokens`` straight to the host tier, which
        holds pages ``[0, first)``: ``device_page_ids[i]`` (from ``allocate``) holds page
        ``first + i``. The pages are not put on the device tier: a save whose head kvtier holds
        on host only copies its new pages, not the head again. Ownership of every id passes to
        the cache (freed once copied); returns the pages that went to host (0: the host tier
        no longer holds the head, or has no room; nothing stored)."""
        ctx = self.ctx
        if not self.tail_commits:
            raise ValueError("commit_tail needs a host tier under write_through")
        data, key = as_token_bytes(tokens), salt_bytes(salt)
        full = len(data) // ctx.step
        ids = [int(i) for i in device_page_ids]
        if first < 0 or first + len(ids) != full:
            raise ValueError(f"commit_tail of pages [{first}, {full}) got {len(ids)} page ids")
        if len(set(ids)) != len(ids) or any(i not in self.engine_pages for i in ids):
            raise ValueError("commit_tail got device pages not handed out by allocate")
        self.engine_pages.difference_update(ids)
        match = ctx.index.match(data, key)
        keys = ctx.keys(match, full)
        ctx.count("commit_tail_total")
        stored = self.writer.copy_tail(data, key, keys, first, ids, match)
        ctx.count("commit_tail_pages_total", stored)
        return stored

    def hold(self, hit: Hit) -> Held:
        """Pin ``hit``'s host prefix (stores' part landed first); see ``LoadBack.hold``."""
        return self.loader.hold(hit)

    def fill_host(self, tokens: Tokens, fill: HostFill, salt: bytes | str | None = None) -> int:
        """Store the full pages of ``tokens`` past the host tier's prefix straight into host
        pages written by ``fill`` (see ``HostWriter.fill``); returns the prompt's pages the
        host tier holds or will hold once the write is over (0: no room)."""
        if not self.ctx.has_host:
            raise ValueError("fill_host needs a host tier")
        data, key = as_token_bytes(tokens), salt_bytes(salt)
        full = len(data) // self.ctx.step
        match = self.ctx.index.match(data, key)
        keys = self.ctx.keys(match, full)
        self.ctx.count("fill_host_total")
        return self.writer.fill(data, key, keys, fill, match)

    def host_pages(self, hit: Hit) -> int:
        """Pages of ``hit``'s prompt on the host tier from the root (0 without one)."""
        ctx = self.ctx
        if not ctx.has_host:
            return 0
        match = (ctx.index.match(hit._data, hit.salt) if hit._match is None
                 else ctx.index.current(hit._match))
        return match.depth_of("host")

    @property
    def tail_commits(self) -> bool:
        """Whether ``commit_tail`` applies: a host tier written through at every commit."""
        return self.ctx.has_host and self.writer.policy == "write_through"

    def hint(self, tokens: Tokens, hint: CacheHint, salt: bytes | str | None = None,
             tenant: str = "") -> HintOutcome:
        """Apply a request's cache hint to the device path of ``tokens`` (after its commit)."""
        data, key = as_token_bytes(tokens), salt_bytes(salt)
        path = [node for node, _ in self.ctx.index.match(data, key).path]
        return self.hints.apply(path, hint, (tenant or "").encode(), time.monotonic())

    def _check_ownership(self, ids: list[int], full: int, held: list[int]) -> None:
        if len(ids) < full:
            raise ValueError(f"commit of {full} full pages got {len(ids)} device page ids")
        if len(set(ids)) != len(ids):
            raise ValueError("commit got the same device page id twice")
        for page, page_id in enumerate(ids):
            ours = page_id in self.engine_pages or page_id in self.private_owner
            if not ours and not (page < len(held) and held[page] == page_id):
                raise ValueError(f"device page {page_id} (prompt page {page}) was not handed out "
                                 "by allocate or load")

    def release(self, handle: Loaded | Hit | Held) -> None:
        """Unpin a ``Loaded`` (idempotent); a ``Hit`` only stops its early prefetch."""
        if isinstance(handle, Held):
            if not handle.released:
                handle.released = True
                if handle.ticket is not None:   # normally done: the copy that read them ended
                    handle.ticket.wait(None)
                self.ctx.unlock(handle._host_lock_node, "host")
                handle._host_lock_node = None
            return
        if isinstance(handle, Hit):
            task, handle._prefetch = handle._prefetch, None
            if task is not None:
                task.job.cancel()
                self.prefetcher.unhold(task)
            return
        if handle.released:
            return
        handle.released = True
        if handle.ticket is not None:  # normally done: the forward that read it has finished
            handle.ticket.wait(None)
        self.ctx.unlock(handle._host_lock_node, "host")
        self.ctx.unlock(handle._lock_node, "device")
        handle._lock_node = handle._host_lock_node = None
        private = sorted(handle._private)
        handle._private.clear()
        for page_id in private:
            self.private_owner.pop(page_id, None)
        self.ctx.index.free("device", private)

    # ---- background --------------------------------------------------------------------------
    def poll(self) -> None:
        """Reap finished copies and IO jobs, then retry deferred backups (engine thread)."""
        self._forget_lost_stores()
        self.writer.poll()
        workers = self.ctx.workers
        if workers is None:
            return
        for job in workers.completed():
            if self.prefetcher.owns(job):
                self._observe_job("prefetch", job)
                self.prefetcher.reap(job)
            elif self.backups.owns(job):
                self.backups.reap(job)
        self.backups.retry_deferred()

    def _forget_lost_stores(self) -> None:
        """Drop the index's marks of a store tier whose pages may be gone (its ``epoch`` grew:
        reopened, its directory replaced, its server restarted empty), so lookups stop
        promising them and commits write them again at once."""
        for tier, store in self.ctx.stores.items():
            epoch, seen = store.epoch, self._store_epochs.get(tier)
            if epoch != seen:
                self._store_epochs[tier] = epoch
                if seen is not None:
                    self.ctx.count(f"store_lost_total.{tier}")
                    self.ctx.count(f"store_lost_pages_total.{tier}", self.ctx.index.clear(tier))

    def _observe_job(self, kind: str, job: PrefetchJob) -> None:
        if job.landed and job.segments and job.finished_at > job.started:
            tier = job.segments[0].tier
            self.rates.observe(tier, job.landed * self.ctx.device_pool.layout.page_bytes,
                               job.finished_at - job.started)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until no copy or IO job is in flight (reaping them) and every backup the cache
        took on ended: written whole, or refused, abandoned, lost or dropped (each counted and
        logged, see ``Backups``); False on timeout."""
        deadline = time.monotonic() + (self.ctx.config.job_deadline_s if timeout_s is None
                                       else timeout_s)
        self.writer.drain()
        while True:
            self.poll()
            workers = self.ctx.workers
            busy = workers is not None and (not workers.idle() or self.prefetcher.busy()
                                            or not self.backups.idle())
            if not busy:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)

    def flush(self) -> dict[str, int]:
        """Drop the device and host tiers (pinned pages stay); stores keep everything."""
        self.drain()
        dropped = self.ctx.index.clear_tiers(("device", "host"))
        self.ctx.count("flush_total")
        return dropped

    def outstanding(self) -> dict[str, int]:
        owners = {id(x): x for x in self.private_owner.values()}.values()
        private = sum(len(loaded._private) for loaded in owners)
        return {"device": len(self.engine_pages) + private + self.ctx.device_outside,
                "host": self.ctx.host_outside}

    def check_integrity(self) -> None:
        ctx = self.ctx
        ctx.index.check_integrity(self.outstanding())
        ctx.device_pool.allocator.check_integrity()
        if ctx.host_pool is not None and ctx.has_host:
            ctx.host_pool.allocator.check_integrity()
        owners = {id(x): x for x in self.private_owner.values()}.values()
        if len(self.private_owner) != sum(len(x._private) for x in owners):
            raise AssertionError("private device page ledger out of step")
        for node in ctx.index.iter_nodes():
            if not node.keys:
                raise AssertionError(f"{node!r} has no page keys")
