"""Store backups: host pages -> disk and remote stores, after their host copy completed.

Owns ``Backups``. For each store tier, a path's backup covers host pages
``[store depth, host depth)``: it starts right below the last page that tier already holds, so
a page reaches a store only if its parent did, and the index marks a tier only on a prefix the
store confirmed (``BackupJob`` stops at the first refusal and removes anything written past it).
A page whose parent's backup is still in flight waits (``deferred``, bounded, retried on every
poll) instead of racing it on another worker.

Each backup is charged to ``WriteAdmission`` (the staging bound: the host share not reserved for
prefetch landing) before its host pages are locked; a job takes at most the room left, and a
path that finds no room is counted and deferred. While a job runs, its host pages are locked on
host.

Engine thread only; the jobs themselves run on IO workers.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

from kvtier.controller.context import CacheContext
from kvtier.controller.jobs import BackupJob
from kvtier.index.match import IndexMatch
from kvtier.index.residency import Node

MAX_PAGES_PER_JOB = 256
MAX_DEFERRED = 256


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
        self.deferred: deque[tuple[bytes, bytes, Sequence[bytes]]] = deque(maxlen=MAX_DEFERRED)
        self._ops = itertools.count(1)

    def want(self, data: bytes, salt: bytes, keys: Sequence[bytes],
             match: IndexMatch | None = None) -> None:
        """Back up what this path has on host and a store lacks (every store tier);
        ``match``: a walk of ``data`` to reuse while the index is unchanged."""
        if not self.ctx.stores or self.ctx.workers is None:
            return
        for tier, store in self.ctx.stores.items():
            if store.available:  # a tier that is off takes no backups (it may come back)
                match = self._schedule(tier, data, salt, keys, match)

    def _schedule(self, tier: str, data: bytes, salt: bytes, keys: Sequence[bytes],
                  match: IndexMatch | None) -> IndexMatch:
        """Submit one backup job of the path's next pages for ``tier``; returns the walk."""
        ctx = self.ctx
        match = ctx.index.match(data, salt) if match is None else ctx.index.current(match)
        lo, hi = match.depth_of(tier), min(match.depth_of("host"), len(keys))
        if lo >= hi:
            return match
        busy = self.in_flight[tier]
        admission, workers = ctx.admission, ctx.workers
        assert admission is not None and workers is not None, "backups without IO workers"
        room = admission.capacity_pages - admission.used_pages
        n = 0
        while n < min(hi - lo, MAX_PAGES_PER_JOB, room) and bytes(keys[lo + n]) not in busy:
            n += 1
        if n == 0:
            if room <= 0:
                ctx.count(f"backup_refused_total.{tier}")
            self._defer(data, salt, keys)
            return match
        op_id = ("backup", tier, next(self._ops))
        if not admission.admit(op_id, n):
            ctx.count(f"backup_refused_total.{tier}")
            self._defer(data, salt, keys)
            return match
        host_node, match = ctx.lock_on(match, lo + n, "host")
        host_ids = match.ids("host", lo, lo + n)
        job = BackupJob(tier, ctx.stores[tier], [bytes(k) for k in keys[lo:lo + n]], host_ids,
                        ctx.config.job_deadline_s)
        if not workers.submit(job):
            admission.release(op_id, "failure")
            ctx.unlock(host_node, "host")
            ctx.count(f"backup_refused_total.{tier}")
            return match
        admission.occupy(op_id, n)
        busy.update(job.keys)
        self.tasks[job.id] = BackupTask(job, data, salt, keys, lo, op_id, host_node)
        if lo + n < hi:
            self._defer(data, salt, keys)  # the rest follows once this part is confirmed
        return match

    def _defer(self, data: bytes, salt: bytes, keys: Sequence[bytes]) -> None:
        if len(self.deferred) == self.deferred.maxlen:
            self.ctx.count("backup_deferred_dropped_total")
        self.deferred.append((data, salt, keys))

    def owns(self, job: object) -> TypeGuard[BackupJob]:
        return getattr(job, "id", None) in self.tasks

    def reap(self, job: BackupJob) -> None:
        """A backup job ended: mark what the store confirmed, release its charge and locks."""
        ctx = self.ctx
        task = self.tasks.pop(job.id)
        if job.written:
            ctx.index.insert(task.data, task.keys, tier=job.tier, start=task.lo,
                             stop=task.lo + job.written, salt=task.salt, strict=False)
        ctx.unlock(task.host_node, "host")
        assert ctx.admission is not None, "a backup ended without a write admission"
        ctx.admission.release(task.op_id, "ack" if job.outcome == "completed" else "failure")
        self.in_flight[job.tier].difference_update(job.keys)
        ctx.count(f"backup_pages_total.{job.tier}", job.written)
        ctx.count(f"backup_total.{job.tier}.{job.outcome}")

    def retry_deferred(self) -> None:
        for _ in range(len(self.deferred)):
            data, salt, keys = self.deferred.popleft()
            self.want(data, salt, keys)

    def busy(self) -> bool:
        return bool(self.tasks)

