"""IO workers: loads before stores, bounded queues, deadlines, cancel, and no dying threads."""

from __future__ import annotations

import threading
import time

import pytest

from cache_support import LAYOUT
from kvtier.controller.jobs import LOAD, STORE, BackupJob, HostPages, Job, PrefetchJob, Segment
from kvtier.controller.workers import IOWorkers
from kvtier.memory import HostPool, PinnedBudget
from kvtier.store.memory import MemoryStore


class Blocker(Job):
    """A job that holds its worker until released."""

    def __init__(self, priority: int = STORE) -> None:
        super().__init__(deadline_s=30)
        self.priority = priority
        self.gate = threading.Event()
        self.running = threading.Event()

    def run(self, host: HostPages) -> str:
        self.running.set()
        self.gate.wait(10)
        return "completed"


class Boom(Job):
    def run(self, host: HostPages) -> str:
        raise RuntimeError("bug in a store")


@pytest.fixture
def host_pool() -> HostPool:
    pool = HostPool(LAYOUT, 8, PinnedBudget(1 << 20))
    yield pool
    pool.close()


def finished(workers: IOWorkers, count: int, timeout: float = 5.0) -> list[Job]:
    done: list[Job] = []
    deadline = time.monotonic() + timeout
    while len(done) < count and time.monotonic() < deadline:
        done += workers.completed()
        time.sleep(0.005)
    return done


def test_loads_run_before_stores(host_pool: HostPool) -> None:
    workers = IOWorkers(host_pool, workers=1, queue_depth=8)
    gate = Blocker()
    workers.submit(gate)
    assert gate.running.wait(5)
    store, load = Blocker(STORE), Blocker(LOAD)
    store.gate.set()
    load.gate.set()
    workers.submit(store)
    workers.submit(load)
    gate.gate.set()
    done = finished(workers, 3)
    assert [job is load for job in done[1:]] == [True, False]
    workers.close()


def test_a_full_queue_refuses_and_counts(host_pool: HostPool) -> None:
    workers = IOWorkers(host_pool, workers=1, queue_depth=1)
    gate = Blocker()
    workers.submit(gate)
    assert gate.running.wait(5)
    assert workers.submit(Blocker())
    assert not workers.submit(Blocker())
    assert workers.stats()["refused"] == 1
    gate.gate.set()
    workers.close()


def test_a_job_that_raises_is_an_error_and_the_worker_goes_on(host_pool: HostPool) -> None:
    workers = IOWorkers(host_pool, workers=1, queue_depth=4)
    boom, after = Boom(deadline_s=5), Blocker()
    after.gate.set()
    workers.submit(boom)
    workers.submit(after)
    done = finished(workers, 2)
    assert [job.outcome for job in done] == ["error", "completed"]
    assert "bug in a store" in (boom.error or "")
    workers.close()


def test_an_expired_job_never_touches_the_store(host_pool: HostPool) -> None:
    store = MemoryStore(LAYOUT.page_bytes)
    job = PrefetchJob([Segment("disk", store, (b"k" * 32,))], [0], deadline_s=0.0)
    time.sleep(0.01)
    workers = IOWorkers(host_pool, workers=1, queue_depth=4)
    workers.submit(job)
    assert [j.outcome for j in finished(workers, 1)] == ["expired"]
    assert store.stats().misses == 0
    workers.close()


def test_close_cancels_queued_jobs(host_pool: HostPool) -> None:
    workers = IOWorkers(host_pool, workers=1, queue_depth=4)
    gate = Blocker()
    workers.submit(gate)
    assert gate.running.wait(5)
    queued = BackupJob("disk", MemoryStore(LAYOUT.page_bytes), [b"k" * 32], [0], deadline_s=5)
    workers.submit(queued)
    threading.Timer(0.05, gate.gate.set).start()
    workers.close()
    assert queued.outcome == "cancelled" and queued.is_done()
    assert not workers.submit(Blocker())


def test_prefetch_job_publishes_a_landed_prefix_and_stops_at_a_miss(host_pool: HostPool) -> None:
    store = MemoryStore(LAYOUT.page_bytes)
    keys = [bytes([i]) * 32 for i in range(6)]
    pages = [bytes([i]) * LAYOUT.page_bytes for i in range(6)]
    store.write(keys[:4] + keys[5:], pages[:4] + pages[5:])  # page 4 is missing
    job = PrefetchJob([Segment("disk", store, tuple(keys))], list(range(6)), deadline_s=5,
                      batch_pages=2)
    job.execute(HostPages(host_pool))
    assert (job.outcome, job.landed, job.missed_tier) == ("failed", 4, "disk")
    for i in range(4):
        assert bytes(host_pool.page(i).numpy()) == pages[i]
