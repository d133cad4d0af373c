"""Store backups: host pages -> disk and remote stores, after their host copy completed.

Owns ``Backups``. For each store tier, a path's backup covers host pages
``[store depth, host depth)``: it starts right below the last page that tier already holds, so
a page reaches a store only if its parent did, and the index marks a tier only on a prefix the
store confirmed (``BackupJob`` stops at the first refusal and removes anything written past it).

A backup the cache acknowledged (its host copy completed) is owed until the store holds it or
the cache says, counted and logged, why it never will. Until then the path is *pending* (one
entry per tier and prompt, retried on every poll): while its parent's job is in flight, while
the staging ring (``WriteAdmission``, the host share not reserved for prefetch landing) has no
room, and while the IO queue is full (back-pressure: nothing is dropped for want of room). A
pending path ends only as:

- written: the store holds every page it owed;
- refused (``backup_refused_pages_total``): the store said no to a page (cap reached, disk full,
  tier off);
- abandoned (``backup_abandoned_pages_total``): ``MAX_ATTEMPTS`` jobs in a row ended short
  without progress (expired, error);
- lost (``backup_lost_pages_total``): the host tier evicted pages before they were backed up;
- dropped (``backup_dropped_pages_total``): more than ``MAX_PENDING`` paths were owed at once.

Each of those is also a rate-limited WARNING. ``idle()`` is what ``drain`` waits for.

Each backup is charged to ``WriteAdmission`` before its host pages are locked; a job takes at
most the room left. While a job runs, its host pages are locked on host.

Engine thread only; the jobs themselves run on IO workers.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

from kvtier.controller.context import CacheContext
from kvtier.controller.jobs import BackupJob
from kvtier.index.match import IndexMatch
from kvtier.index.residency import Node
from kvtier.store.pacing import LogLimiter

log = logging.getLogger(__name__)

MAX_PAGES_PER_JOB = 256
MAX_PENDING = 1024     # paths owed at once (per tier), past it the oldest is dropped (logged)
MAX_ATTEMPTS = 3       # jobs in a row that end short without progress before giving up
LOG_INTERVAL_S = 10.0

PathKey = tuple[str, bytes, bytes]  # (tier, salt, token bytes)


@dataclass
class Pending:
    """A path's backup still owed to one tier: pages ``[0, target)``."""

    keys: Sequence[bytes]
    target: int
    attempts: int = 0      # jobs in a row that ended short without progress


@dataclass
class BackupTask:
    job: BackupJob
    data: bytes
    salt: bytes
    keys: Sequence[bytes]
    lo: int
    op_id: tuple[str, str, int]
    host_node: Node | None


class Backups:
    """Schedules and reaps host -> store backup jobs."""

    def __init__(self, ctx: CacheContext) -> None:
        self.ctx = ctx
        self.tasks: dict[int, BackupTask] = {}
        self.in_flight: dict[str, set[bytes]] = {tier: set() for tier in ctx.stores}
        self.pending: OrderedDict[PathKey, Pending] = OrderedDict()
        self.logs = LogLimiter(log, LOG_INTERVAL_S)
        self._ops = itertools.count(1)

    @property
    def deferred(self) -> list[PathKey]:
        """Paths whose backup is still owed (read-only view, oldest first)."""
        return list(self.pending)

    def want(self, data: bytes, salt: bytes, keys: Sequence[bytes],
             match: IndexMatch | None = None) -> None:
        """Back up what this path has on host and a store lacks (every store tier);
        ``match``: a walk of ``data`` to reuse while the index is unchanged."""
        if not self.ctx.stores or self.ctx.workers is None:
            return
        for tier in self.ctx.stores:
            match = self._schedule(tier, data, salt, keys, match)

    def retry_deferred(self) -> None:
        for (tier, salt, data), entry in list(self.pending.items()):
            if self.pending.get((tier, salt, data)) is entry:
                self._schedule(tier, data, salt, entry.keys, None)

    def idle(self) -> bool:
        """Nothing in flight and nothing owed: every acknowledged backup ended (see above)."""
        return not self.tasks and not self.pending

    def busy(self) -> bool:
        return bool(self.tasks)

    # ---- scheduling ----------------------------------------------------------------------
    def _schedule(self, tier: str, data: bytes, salt: bytes, keys: Sequence[bytes],
                  match: IndexMatch | None) -> IndexMatch:
        """Submit one backup job of the path's next pages for ``tier``; returns the walk."""
        ctx = self.ctx
        match = ctx.index.match(data, salt) if match is None else ctx.index.current(match)
        path = (tier, salt, data)
        entry = self.pending.get(path)
        lo, hi = match.depth_of(tier), min(match.depth_of("host"), len(keys))
        target = max(hi, entry.target if entry is not None else 0)
        if lo >= target:
            self.pending.pop(path, None)
            return match
        store = ctx.stores.get(tier)
        if store is None or not store.available:  # a tier that is off takes no backups
            self._give_up(path, target - lo, "refused",
                          "the tier is off" if store else "the tier was detached")
            return match
        if hi < target:  # the host tier evicted pages before they reached the store
            self._give_up(path, target - max(lo, hi), "lost",
                          "the host tier evicted them first")
            if lo >= hi:
                return match
            target = hi
        entry = self._owe(path, keys, target)
        busy = self.in_flight.setdefault(tier, set())
        admission, workers = ctx.admission, ctx.workers
        assert admission is not None and workers is not None, "backups without IO workers"
        room = admission.capacity_pages - admission.used_pages
        n = 0
        while n < min(hi - lo, MAX_PAGES_PER_JOB, room) and bytes(keys[lo + n]) not in busy:
            n += 1
        if n == 0:
            if room <= 0:
                ctx.count(f"backup_refused_total.{tier}")  # put off: no staging room now
            return match
        op_id = ("backup", tier, next(self._ops))
        if not admission.admit(op_id, n):
            ctx.count(f"backup_refused_total.{tier}")
            return match
        host_node, match = ctx.lock_on(match, lo + n, "host")
        host_ids = match.ids("host", lo, lo + n)
        job = BackupJob(tier, store, [bytes(k) for k in keys[lo:lo + n]], host_ids,
                        ctx.config.job_deadline_s)
        if not workers.submit(job):  # the IO queue is full: stays owed, retried next poll
            admission.release(op_id, "failure")
            ctx.unlock(host_node, "host")
            ctx.count(f"backup_refused_total.{tier}")
            return match
        admission.occupy(op_id, n)
        busy.update(job.keys)
        self.tasks[job.id] = BackupTask(job, data, salt, keys, lo, op_id, host_node)
        return match

    def _owe(self, path: PathKey, keys: Sequence[bytes], target: int) -> Pending:
        entry = self.pending.get(path)
        if entry is not None:
            entry.keys, entry.target = keys, target
            return entry
        tier_paths = [p for p in self.pending if p[0] == path[0]]
        if len(tier_paths) >= MAX_PENDING:
            oldest = tier_paths[0]
            self._give_up(oldest, self.pending[oldest].target, "dropped",
                          f"more than {MAX_PENDING} prompts were waiting for it")
        entry = self.pending[path] = Pending(keys, target)
        return entry

    def _give_up(self, path: PathKey, pages: int, how: str, why: str) -> None:
        """End ``path``'s pending backup short by ``pages``: counted and logged."""
        self.pending.pop(path, None)
        tier = path[0]
        self.ctx.count(f"backup_{how}_pages_total.{tier}", pages)
        self.logs.log(logging.WARNING, (how, tier), f"{tier} tier: {pages} pages of a "
                      f"{len(path[2]) // self.ctx.step}-page prompt were not stored ({how}: "
                      f"{why}); counted as backup_{how}_pages_total")

    # ---- completions -----------------------------------------------------------------------
    def owns(self, job: object) -> TypeGuard[BackupJob]:
        return getattr(job, "id", None) in self.tasks

    def reap(self, job: BackupJob) -> None:
        """A backup job ended: mark what the store confirmed, release its charge and locks,
        and settle the path's pending entry on a short end."""
        ctx = self.ctx
        task = self.tasks.pop(job.id)
        if job.written:
            ctx.index.insert(task.data, task.keys, tier=job.tier, start=task.lo,
                             stop=task.lo + job.written, salt=task.salt, strict=False)
        ctx.unlock(task.host_node, "host")
        assert ctx.admission is not None, "a backup ended without a write admission"
        ctx.admission.release(task.op_id, "ack" if job.outcome == "completed" else "failure")
        self.in_flight.get(job.tier, set()).difference_update(job.keys)
        ctx.count(f"backup_pages_total.{job.tier}", job.written)
        ctx.count(f"backup_total.{job.tier}.{job.outcome}")
        path = (job.tier, task.salt, task.data)
        entry = self.pending.get(path)
        if job.outcome == "completed" or entry is None:
            return
        left = entry.target - (task.lo + job.written)
        if job.outcome == "failed":  # the store refused a page: its answer, not a hiccup
            self._give_up(path, left, "refused", "the store refused a write (a full disk, "
                          "its max_bytes or min_free_bytes, or an outage: see its health)")
            return
        entry.attempts = 0 if job.written else entry.attempts + 1
        if entry.attempts >= MAX_ATTEMPTS:
            self._give_up(path, left, "abandoned", f"{MAX_ATTEMPTS} backup jobs in a row "
                          f"ended {job.outcome} without progress ({job.error or 'no error'})")
