"""IO jobs: what an IO worker runs (store -> host prefetch, host -> store backup) and how it ends.

Owns ``Job`` (id, priority, deadline, cooperative cancel, completion event, outcome) and its two
kinds. A job touches bytes only: host pages it was handed (ids reserved by the controller on the
engine thread) and a ``PageStore``; it never touches the index. Progress is published in plain
ints that the engine thread may read at any time (``PrefetchJob.landed``: pages ``[0, landed)``
are complete and the worker will not write them again).

Threads: built and reaped on the engine thread, ``run`` on one IO worker thread. A job never
raises out of ``run``: a store exception is recorded as the job's ``error`` and its pages count
as misses (a worker never dies, a tier is never switched off).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.store.base import PageStore

if TYPE_CHECKING:
    import torch

    from kvtier.memory.host_pool import HostPool

LOAD, STORE = 0, 1  # priorities: loads (prefetch) are served before stores (backup)
OUTCOMES = ("completed", "partial", "failed", "cancelled", "expired", "error")
_ids = itertools.count(1)


class HostPages:
    """How a job reaches host pages: a direct view (page_first) or staging copies (layer_first)."""

    def __init__(self, host_pool: HostPool) -> None:
        self.pool = host_pool
        self.direct = host_pool.host_layout == "page_first"

    def buffers(self, ids: Sequence[int]) -> list[torch.Tensor]:
        if self.direct:
            return [self.pool.page(h) for h in ids]
        import torch

        return [torch.empty(self.pool.page_bytes, dtype=torch.uint8) for _ in ids]

    def fill_from(self, ids: Sequence[int], buffers: Sequence[torch.Tensor]) -> None:
        """After a read into staging buffers: copy them into the (layer_first) pool."""
        if not self.direct:
            for h, buf in zip(ids, buffers, strict=True):
                self.pool.copy_page_in(h, buf)

    def read_out(self, ids: Sequence[int]) -> list[torch.Tensor]:
        """Buffers holding pages ``ids`` in canonical order, for a store write."""
        if self.direct:
            return [self.pool.page(h) for h in ids]
        out = self.buffers(ids)
        for h, buf in zip(ids, out, strict=True):
            self.pool.copy_page_out(h, buf)
        return out


class Job:
    """One unit of IO work with a deadline and a cooperative cancel flag."""

    priority = STORE
    kind = "job"
    #: The deadline runs from when a worker starts the job, not from when it was queued.
    deadline_from_start = False

    def __init__(self, deadline_s: float, batch_pages: int = 16) -> None:
        self.id = next(_ids)
        self.deadline_s = deadline_s
        self.deadline = time.monotonic() + deadline_s
        self.batch_pages = max(1, batch_pages)
        self.outcome: str | None = None
        self.error: str | None = None
        self.started = 0.0
        self.finished_at = 0.0
        self._cancel = threading.Event()
        self._done = threading.Event()

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def expired(self) -> bool:
        return time.monotonic() > self.deadline

    def should_stop(self) -> str | None:
        if self._cancel.is_set():
            return "cancelled"
        if self.expired():
            return "expired"
        return None

    def is_done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None) -> bool:
        return self._done.wait(timeout)

    def join(self) -> tuple[bool, bool]:
        """A worker found this job at the head of its queue: (run it, leave it queued for
        another worker to join too). One worker runs a plain job."""
        return True, False

    def execute(self, host: HostPages) -> bool:
        """Worker entry: run, record the outcome, signal done; True: the job ended (the worker
        posts it). Never raises."""
        self.started = time.monotonic()
        if self.deadline_from_start:
            self.deadline = self.started + self.deadline_s
        try:
            self.outcome = self.should_stop() or self.run(host)
        except Exception as exc:  # a store outage or bug: a counted failure, never a dead worker
            self.outcome, self.error = "error", f"{type(exc).__name__}: {exc}"
        finally:
            self.finished_at = time.monotonic()
            self._done.set()
        return True

    def run(self, host: HostPages) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class Segment:
    """Pages ``keys`` to read from ``store`` (the tier named ``tier``)."""

    tier: str
    store: PageStore
    keys: tuple[bytes, ...]


class PrefetchJob(Job):
    """Read pages from stores (segment by segment, in prefix order) into reserved host pages.

    The pages are cut into batches of ``batch_pages``; up to ``max_workers`` IO workers run the
    job together, each claiming the next batch in prefix order (one thread reads from the page
    cache at a few GB/s, the checksums included; a burst needs several). ``landed`` grows as
    the leading batches complete; the first page that misses ends the job (no batch past it is
    claimed, the served prefix stops there), and ``missed_tier`` names the store that missed.
    The job ends (``is_done``) once every worker that took part let go of its pages.
    """

    priority = LOAD
    kind = "prefetch"

    def __init__(self, segments: Sequence[Segment], host_ids: Sequence[int], deadline_s: float,
                 batch_pages: int = 16, max_workers: int = 1) -> None:
        super().__init__(deadline_s, batch_pages)
        self.segments = tuple(segments)
        self.host_ids = list(host_ids)
        self.pages = sum(len(s.keys) for s in self.segments)
        if self.pages != len(self.host_ids):
            raise ValueError(f"{self.pages} pages to read into {len(self.host_ids)} host pages")
        self.max_workers = max(1, max_workers)
        self.landed = 0
        self.missed_tier: str | None = None
        # batches: (segment, first key in it, keys, first page of the job)
        self._batches: list[tuple[Segment, int, int, int]] = []
        pos = 0
        for segment in self.segments:
            for lo in range(0, len(segment.keys), self.batch_pages):
                n = min(self.batch_pages, len(segment.keys) - lo)
                self._batches.append((segment, lo, n, pos + lo))
            pos += len(segment.keys)
        self._got: list[int | None] = [None] * len(self._batches)  # pages landed per batch
        self._lock = threading.Lock()
        self._next = self._front = self._workers = self._joined = 0
        self._miss_at = len(self._batches)  # the first batch that came back short
        self._stop: str | None = None      # "missed", "error", or why a worker stopped
        self._ended = False

    def join(self) -> tuple[bool, bool]:
        with self._lock:
            if self._ended or self._stop or self._next >= len(self._batches):
                return False, False
            self._workers += 1
            self._joined += 1
            return True, self._workers < self.max_workers and self._next < len(self._batches)

    def execute(self, host: HostPages) -> bool:
        with self._lock:
            if self._joined:
                self._joined -= 1
            else:  # called without ``join`` (directly, one worker)
                self._workers += 1
            if not self.started:
                self.started = time.monotonic()
        while (claim := self._claim()) is not None:
            segment, lo, n, first = self._batches[claim]
            try:
                keys = segment.keys[lo:lo + n]
                ids = self.host_ids[first:first + n]
                buffers = host.buffers(ids)
                ok = _leading_true(segment.store.read_into(keys, buffers))
                host.fill_from(ids[:ok], buffers[:ok])
            except Exception as exc:  # a store outage or bug: a counted failure
                ok = 0
                with self._lock:
                    self.error = self.error or f"{type(exc).__name__}: {exc}"
                    self._stop = "error"
            self._landed(claim, ok, n, segment.tier)
        with self._lock:
            self._workers -= 1
            if self._workers or self._ended:
                return False
            self._ended = True
            self.outcome = self._outcome()
            self.finished_at = time.monotonic()
        self._done.set()
        return True

    def _claim(self) -> int | None:
        with self._lock:
            if not self._stop:
                self._stop = self.should_stop()
            if self._stop or self._next >= len(self._batches):
                return None
            self._next += 1
            return self._next - 1

    def _landed(self, batch: int, ok: int, n: int, tier: str) -> None:
        with self._lock:
            self._got[batch] = ok
            if ok < n and self._stop != "error":
                self._stop = "missed"
                if batch < self._miss_at:
                    self._miss_at, self.missed_tier = batch, tier
            while self._front < len(self._got) and self._got[self._front] is not None:
                got, (_, _, size, first) = self._got[self._front], self._batches[self._front]
                self.landed = first + (got or 0)
                if got != size:
                    break
                self._front += 1

    def _outcome(self) -> str:
        if self.landed == self.pages:
            return "completed"
        if self._stop == "error":
            return "error"
        if self._stop == "missed":
            return "failed"
        stop = self._stop or "cancelled"
        return stop if self.landed == 0 else "partial"

    def run(self, host: HostPages) -> str:
        raise NotImplementedError("a prefetch runs through execute")


class BackupJob(Job):
    """Write host pages to one store in prefix order; stop at the first refusal (and delete
    what the same batch wrote past it, so the store never holds a page without its parent).

    Pages the store already holds (another process wrote them, or an earlier run) are not
    written again. ``written`` is the count of leading pages now in the store. Its deadline
    runs from its start: a backup queued behind others (a burst) is late, not stale.
    """

    priority = STORE
    kind = "backup"
    deadline_from_start = True

    def __init__(self, tier: str, store: PageStore, keys: Sequence[bytes],
                 host_ids: Sequence[int], deadline_s: float, batch_pages: int = 16) -> None:
        super().__init__(deadline_s, batch_pages)
        if len(keys) != len(host_ids):
            raise ValueError(f"{len(keys)} keys for {len(host_ids)} host pages")
        self.tier = tier
        self.store = store
        self.keys = tuple(keys)
        self.host_ids = list(host_ids)
        self.written = 0

    def run(self, host: HostPages) -> str:
        for lo in range(0, len(self.keys), self.batch_pages):
            stop = self.should_stop()
            if stop:
                return stop if self.written == 0 else "partial"
            keys = self.keys[lo:lo + self.batch_pages]
            ids = self.host_ids[lo:lo + len(keys)]
            present = self.store.contains(keys)
            todo = [i for i, have in enumerate(present) if not have]
            done = list(present)
            if todo:
                written = self.store.write([keys[i] for i in todo],
                                           host.read_out([ids[i] for i in todo]))
                for i, stored in zip(todo, written, strict=True):
                    done[i] = stored
            ok = _leading_true(done)
            self.written = lo + ok
            if ok < len(keys):
                # keep the store's prefix contiguous: undo what this batch wrote past the gap
                orphans = [keys[i] for i in todo if i > ok and done[i]]
                if orphans:
                    self.store.delete(orphans)
                return "failed"
        return "completed"


def _leading_true(flags: Sequence[bool]) -> int:
    for i, flag in enumerate(flags):
        if not flag:
            return i
    return len(flags)
