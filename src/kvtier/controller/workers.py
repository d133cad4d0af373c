"""IO workers: a fixed set of threads that run store jobs, loads ahead of stores.

Owns ``IOWorkers``. The engine thread ``submit``s jobs into two bounded queues (prefetch loads
and backup stores; one shared bound, ``controller.io_queue_depth``); a full queue refuses the
job (counted) instead of blocking the engine. Each worker takes the oldest load if any, else the
oldest store, runs it (``Job.execute`` never raises), and posts it to the completion queue that
the engine thread drains with ``completed()``. A prefetch stays at the head of its queue while
it has batches left and takes fewer workers than it may (``Job.join``): the next free workers
join it, and the last one out posts it. A job whose deadline passed while queued ends as
``expired`` without touching a store (a backup's deadline runs from its start instead).
``close`` stops the threads; a thread stuck inside a store call past the join timeout is left
behind as a daemon and counted.

Threads: ``submit``/``completed``/``stats``/``close`` on the engine thread; ``_loop`` on each
worker thread. One condition variable guards the queues.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING

from kvtier.controller.jobs import LOAD, HostPages, Job

if TYPE_CHECKING:
    from kvtier.memory.host_pool import HostPool


class IOWorkers:
    """Threads running IO jobs from two bounded queues (loads first)."""

    def __init__(self, host_pool: HostPool, workers: int, queue_depth: int,
                 name: str = "kvtier-io") -> None:
        if workers < 1 or queue_depth < 1:
            raise ValueError(f"need workers >= 1 and queue_depth >= 1, got {workers}, {queue_depth}")
        self._host = HostPages(host_pool)
        self._depth = queue_depth
        self._cond = threading.Condition()
        self._queues: tuple[deque[Job], deque[Job]] = (deque(), deque())
        self._done: deque[Job] = deque()
        self._running = 0
        self._closing = False
        self._counts = {"submitted": 0, "refused": 0, "completed": 0, "stuck_on_close": 0}
        self._threads = [threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    @property
    def host_pool(self) -> HostPool:
        """The ``HostPool`` whose pages the jobs read and write (read-only)."""
        return self._host.pool

    def submit(self, job: Job) -> bool:
        """Queue ``job``; False (counted, nothing queued) when the queues are full or closing."""
        with self._cond:
            if self._closing or self.queued() >= self._depth:
                self._counts["refused"] += 1
                return False
            self._queues[0 if job.priority == LOAD else 1].append(job)
            self._counts["submitted"] += 1
            self._cond.notify()
            return True

    def queued(self) -> int:
        return len(self._queues[0]) + len(self._queues[1])

    def completed(self) -> list[Job]:
        """Jobs finished since the last call, in completion order (engine thread)."""
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def idle(self) -> bool:
        with self._cond:
            return not self.queued() and not self._running

    def _next(self) -> Job | None:
        with self._cond:
            while True:
                while not self._closing and not self.queued():
                    self._cond.wait()
                if self._closing and not self.queued():
                    return None
                queue = self._queues[0] if self._queues[0] else self._queues[1]
                job = queue[0]
                take, stay = job.join()  # a prefetch stays queued for more workers to join
                if not stay:
                    queue.popleft()
                if take:
                    self._running += 1
                    if stay:
                        self._cond.notify()
                    return job

    def _loop(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            ended = False
            try:
                ended = job.execute(self._host)
            finally:
                with self._cond:
                    self._running -= 1
                    self._counts["completed"] += ended
                if ended:  # the last of the workers that ran it posts it
                    self._done.append(job)

    def close(self, timeout_s: float = 5.0) -> None:
        """Cancel queued and running jobs, stop the threads (queued jobs end as cancelled)."""
        with self._cond:
            if self._closing:
                return
            pending = list(self._queues[0]) + list(self._queues[1])
            for job in pending:
                job.cancel()
            self._closing = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout_s)
            if thread.is_alive():
                self._counts["stuck_on_close"] += 1

    def stats(self) -> dict[str, object]:
        with self._cond:
            return {"workers": len(self._threads), "queue_depth": self._depth,
                    "queued_loads": len(self._queues[0]), "queued_stores": len(self._queues[1]),
                    "running": self._running, **self._counts}
