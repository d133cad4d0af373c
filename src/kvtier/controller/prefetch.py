"""Prefetch: store -> host for the part of a prefix that only a store holds.

Owns ``Prefetcher`` and the prefetch policies (``controller.prefetch_policy``):

- ``best_effort``: a request never waits; it uses what has landed when it loads, and the job goes
  on in the background — pages landing later enter the host tier for the next request;
- ``wait_complete``: a request waits for the whole prefetch (bounded by the job deadline);
- ``timeout`` (default): a request waits at most
  ``min(prefetch_timeout_base_s + prefetch_timeout_per_1k_tokens_s * tokens / 1000,
  prefetch_timeout_max_s)`` from the moment the prefetch started (defaults 50 ms + 20 ms per 1k
  tokens, capped at 2 s). Then the job is reaped: the pages that landed form the served prefix,
  which stops at the first missing page; the job is cancelled and the rest of its host pages are
  released once the worker lets go of them (never earlier: it may still be writing them).

No prefetch starts for fewer than ``min_prefetch_tokens`` tokens (decided on the agreed hit, so
every rank decides alike). Host pages for landing come from the host pool (evicting host leaves
if needed), bounded by the prefetch share of the pool (``host.prefetch_share``); a prefetch that
does not fit is shortened, or refused when nothing fits. Outcomes are counted as
``prefetch_total.<outcome>``: completed, timeout, failed (a store missed or raised),
background (best effort, still landing), refused. A page a store missed (absent, or dropped
there for failing verification) loses the index's mark of that store, from it on, as soon as the
miss is known: the request's own commit then backs it up again.

Engine thread only; the job runs on the IO workers (all of them at once for a long one: one
thread reads from the page cache at a few GB/s, see ``jobs.PrefetchJob``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

from kvtier.config import ControllerConfig
from kvtier.controller.context import CacheContext
from kvtier.controller.jobs import PrefetchJob, Segment
from kvtier.errors import PoolExhausted
from kvtier.index.match import IndexMatch
from kvtier.memory.admission import staging_capacity_pages


def prefetch_budget_s(config: ControllerConfig, tokens: int) -> float:
    """How long a request waits for ``tokens`` tokens of prefetch under the timeout policy."""
    budget = config.prefetch_timeout_base_s + config.prefetch_timeout_per_1k_tokens_s * tokens / 1e3
    return min(budget, config.prefetch_timeout_max_s)


@dataclass
class PrefetchTask:
    """One prefetch: pages ``[lo, lo + job.pages)`` of a prompt, landing in ``job.host_ids``."""

    job: PrefetchJob
    data: bytes
    salt: bytes
    keys: Sequence[bytes]
    lo: int
    disk_end: int          # pages [lo, disk_end) come from disk, the rest from remote
    started: float
    taken: int = 0         # leading pages handed to a load (no longer the job's)
    background: bool = False
    held: bool = False     # started early for a Hit that has not loaded yet: reap waits
    ended: bool = False    # the job finished while held


class Prefetcher:
    """Starts, waits for and reaps prefetch jobs."""

    def __init__(self, ctx: CacheContext, prefetch_share: float) -> None:
        self.ctx = ctx
        self.prefetch_share = prefetch_share
        self.landing = 0
        self.tasks: dict[int, PrefetchTask] = {}

    @property
    def landing_cap(self) -> int:
        """Host pages prefetches may land in: the host pool less the write staging share (follows
        the host pool the context holds now)."""
        pool = self.ctx.host_pool
        pages = pool.num_pages if pool is not None else 0
        return pages - staging_capacity_pages(pages, self.prefetch_share)

    def start(self, data: bytes, salt: bytes, keys: Sequence[bytes], lo: int, hi: int,
              disk_end: int) -> PrefetchTask | None:
        """Start reading pages ``[lo, hi)`` (disk up to ``disk_end``, remote after)."""
        ctx = self.ctx
        n = min(hi - lo, self.landing_cap - self.landing)
        host_ids = self._host_pages(n) if n > 0 else []
        if not host_ids:
            ctx.count("prefetch_total.refused")
            return None
        hi = lo + len(host_ids)
        segments: list[Segment] = []
        if "disk" in ctx.stores and disk_end > lo:
            segments.append(Segment("disk", ctx.stores["disk"], tuple(keys[lo:min(disk_end, hi)])))
        if min(disk_end, hi) < hi and "remote" in ctx.stores:
            segments.append(Segment("remote", ctx.stores["remote"],
                                    tuple(keys[max(lo, disk_end):hi])))
        if sum(len(s.keys) for s in segments) != len(host_ids):
            ctx.index.free("host", host_ids)
            raise ValueError(f"prefetch of pages [{lo}, {hi}) has no store for every page")
        # progress is published per batch: at least four times per job, at most 16 pages apart
        batch = max(1, min(16, len(host_ids) // 4))
        job = PrefetchJob(segments, host_ids, ctx.config.job_deadline_s, batch_pages=batch,
                          max_workers=ctx.config.io_workers)
        assert ctx.workers is not None, "prefetch without IO workers"
        if not ctx.workers.submit(job):
            ctx.index.free("host", host_ids)
            ctx.count("prefetch_total.refused")
            return None
        self.landing += len(host_ids)
        ctx.host_outside += len(host_ids)
        task = PrefetchTask(job, data, salt, keys, lo, disk_end, time.monotonic())
        self.tasks[job.id] = task
        return task

    def _host_pages(self, n: int) -> list[int]:
        sizes = self.ctx.index.sizes("host")
        n = min(n, (sizes.free or 0) + sizes.evictable)
        if n <= 0:
            return []
        try:
            return self.ctx.index.allocate("host", n)
        except PoolExhausted:
            return []

    def _wait_left_s(self, task: PrefetchTask) -> float:
        """How much longer a request may wait for ``task`` under the policy (0: no longer)."""
        config, job = self.ctx.config, task.job
        policy = config.prefetch_policy
        if policy == "wait_complete":
            return max(job.deadline - time.monotonic(), 0.0)
        if policy == "timeout":
            budget = prefetch_budget_s(config, job.pages * self.ctx.page_size)
            return max(task.started + budget - time.monotonic(), 0.0)
        return 0.0

    def waiting(self, task: PrefetchTask) -> bool:
        """Whether ``wait`` would block now: the job still runs and the policy's wait has not
        run out (a caller that must not block polls this and loads once it is False)."""
        return not task.job.is_done() and self._wait_left_s(task) > 0

    def wait(self, task: PrefetchTask) -> int:
        """Wait as the policy says; returns the landed pages the request may use now."""
        config, job = self.ctx.config, task.job
        policy = config.prefetch_policy
        done = job.wait(self._wait_left_s(task))
        landed = job.landed
        if done:
            outcome = "completed" if job.outcome == "completed" else "failed"
            if job.missed_tier is not None:  # now, before this request's commit backs it up
                self.forget_missing(task, task.lo + landed, job.missed_tier)
        elif policy == "best_effort":
            outcome, task.background = "background", True
        else:
            job.cancel()
            outcome = "timeout"
        self.ctx.count(f"prefetch_total.{outcome}")
        return landed

    def take(self, task: PrefetchTask, pages: int) -> list[int]:
        """Hand the first ``pages`` landed host pages to the caller (who inserts or frees them)."""
        pages = max(0, min(pages, task.job.landed) - task.taken)
        ids = task.job.host_ids[task.taken:task.taken + pages]
        task.taken += pages
        self.landing -= pages
        self.ctx.host_outside -= pages
        self.ctx.count("prefetch_served_pages_total", pages)
        return ids

    def busy(self) -> bool:
        """Whether a prefetch job is still running (held tasks that ended do not count)."""
        return any(not task.job.is_done() or not task.ended and not task.held
                   for task in self.tasks.values())

    def owns(self, job: object) -> TypeGuard[PrefetchJob]:
        return getattr(job, "id", None) in self.tasks

    def reap(self, job: PrefetchJob) -> None:
        """The job ended: keep late pages (best effort), release the rest, forget bad flags.
        A task a ``Hit`` still holds is only marked; ``unhold`` finishes it."""
        task = self.tasks[job.id]
        if task.held:
            task.ended = True
            return
        self._finish(task)

    def unhold(self, task: PrefetchTask) -> None:
        """The Hit that held ``task`` has loaded (or was released): reap it if it ended."""
        task.held = False
        if task.ended and task.job.id in self.tasks:
            self._finish(task)

    def _finish(self, task: PrefetchTask) -> None:
        ctx, job = self.ctx, task.job
        del self.tasks[job.id]
        late = job.host_ids[task.taken:job.landed] if task.background else []
        if late:
            kept, _ = self.insert_landed(task, task.taken, late)
            ctx.count("prefetch_late_pages_total", kept)
        rest = job.host_ids[task.taken:]
        keep = set(late)
        ctx.index.free("host", [h for h in rest if h not in keep])
        self.landing -= len(rest)
        ctx.host_outside -= len(rest)
        ctx.count("prefetch_released_pages_total", len(rest) - len(late))
        if job.outcome == "error":
            ctx.count("prefetch_errors_total")
        if job.missed_tier is not None:
            self.forget_missing(task, task.lo + job.landed, job.missed_tier)

    def insert_landed(self, task: PrefetchTask, first: int, host_ids: list[int], *,
                      after: IndexMatch | None = None) -> tuple[int, IndexMatch | None]:
        """Put landed pages ``first..`` of the task into the host tier (where closure allows),
        and mark the stores they came from; the pages it does not take are freed here. Returns
        the pages kept and, given ``after`` (a walk of the task's prompt), the walk as the
        inserts left it (each insert follows the one before)."""
        index = self.ctx.index
        lo = task.lo + first
        result = index.insert(task.data, task.keys, tier="host", ids=host_ids, start=lo,
                              stop=lo + len(host_ids), salt=task.salt, strict=False, after=after)
        index.free("host", result.unused_ids)
        walk = result.match
        for tier, a, b in (("disk", lo, min(task.disk_end, lo + len(host_ids))),
                           ("remote", max(lo, task.disk_end), lo + len(host_ids))):
            if a < b and tier in self.ctx.stores:
                walk = index.insert(task.data, task.keys, tier=tier, start=a, stop=b,
                                    salt=task.salt, strict=False, after=walk).match
        return result.taken, walk

    def forget_missing(self, task: PrefetchTask, page: int, tier: str) -> None:
        """A store missed ``page``: drop the index's belief that the tier holds it (and below)."""
        index = self.ctx.index
        match = index.match(task.data, task.salt)
        if match.depth_of(tier) <= page:
            return
        if page > 0:
            index.boundary(task.data, page, task.salt)
        node = index.boundary(task.data, page + 1, task.salt)
        if node is not None:
            index.drop(node, tier)
            self.ctx.count(f"store_flag_dropped_total.{tier}")
