"""The engine thread and its fair request queue.

Owns ``Scheduler``: ``submit`` (any thread) queues a request per tenant, refusing past
``max_pending`` with ``QueueFull``; the engine thread admits queued requests round-robin across
tenants (one tenant's burst cannot starve another's) while fewer than ``max_running`` sequences
run, and advances all running sequences in one batched step at a time (``Engine.step``:
decodes and prefill chunks in one forward). A sequence the engine preempts (device pool full)
waits at the front and is admitted again before any new request. Every
submitted request ends with exactly one ``FinishEvent`` (done, cancelled, failed or shut down):
none is lost. The cache's ``poll`` runs on this thread between steps, and so do functions other
threads hand over with ``call_soon`` (admin changes, stats snapshots). ``requests`` totals what
finished requests used (tokens by tier, latencies) for ``/metrics``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from typing import Any

from kvtier.engine.engine_calls import EngineCalls
from kvtier.engine.request import FinishEvent, RequestHandle
from kvtier.engine.request_stats import RequestStats
from kvtier.engine.runner import Engine, Sequence
from kvtier.errors import CapacityError

log = logging.getLogger("kvtier.engine")
IDLE_POLL_S = 0.05


class QueueFull(CapacityError):
    """More requests are queued or running than the server accepts."""


class ShuttingDown(RuntimeError):
    """Why a request ends unfinished when the engine thread stops (the server answers 503: the
    same request may succeed on another server or after a restart)."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down")


class Scheduler:
    """Owns the engine thread; see the module docstring."""

    def __init__(self, engine: Engine, *, max_running: int = 4, max_pending: int = 64,
                 poll: Any = None) -> None:
        if max_running < 1 or max_pending < 1:
            raise ValueError("max_running and max_pending must be >= 1")
        self.engine = engine
        self.max_running = max_running
        self.max_pending = max_pending
        self._poll = poll
        self._lock = threading.Condition()
        self._queues: OrderedDict[str, deque[RequestHandle]] = OrderedDict()
        self._pending = 0          # queued + running
        self._running: list[Sequence] = []     # admission order: the newest is preempted first
        self._resume: deque[Sequence] = deque()  # preempted, admitted again before new requests
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.counters = {"submitted": 0, "finished": 0, "rejected": 0, "failed": 0, "cancelled": 0}
        self.requests = RequestStats()
        self.calls = EngineCalls(wake=self._wake)

    # ---- any thread ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvtier-engine", daemon=True)
        self._thread.start()

    def submit(self, handle: RequestHandle) -> RequestHandle:
        with self._lock:
            if self._stopping:
                raise QueueFull("the engine is shutting down")
            if self._pending >= self.max_pending:
                self.counters["rejected"] += 1
                raise QueueFull(f"{self._pending} requests are queued or running "
                                f"(the limit is {self.max_pending}); retry later")
            self._queues.setdefault(handle.request.tenant, deque()).append(handle)
            self._pending += 1
            self.counters["submitted"] += 1
            self._lock.notify()
        return handle

    def call_soon(self, fn: Any) -> Any:
        """Run ``fn()`` on the engine thread between two steps; returns a ``Future``."""
        return self.calls.submit(fn)

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify()

    def stop(self, timeout: float = 30.0) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            queued = sum(len(q) for q in self._queues.values()) + len(self._resume)
            return {"queued": queued, "running": self._pending - queued, **self.counters,
                    **self.engine_stats()}

    def engine_stats(self) -> dict[str, Any]:
        stats = getattr(self.engine, "stats", None)
        return stats() if stats is not None else {}

    # ---- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._step():
                pass
        finally:
            self._drain()

    def _step(self) -> bool:
        """One round: handed-over calls, admit queued requests while there is room (preempted
        sequences first), then one batched step for every running sequence."""
        self.calls.run_pending()
        with self._lock:
            if self._stopping:
                return False
            idle = not self._running and not self._queues and not self._resume
            if idle and not self.calls.waiting():
                self._lock.wait(IDLE_POLL_S)
            admitting = []
            while not idle and len(self._running) + len(admitting) < self.max_running:
                item = self._resume.popleft() if self._resume else self._next_queued()
                if item is None:
                    break
                admitting.append(item)
        if idle:
            self._poll_cache()
            return True
        for item in admitting:
            self._admit(item)
        self._drop_cancelled()
        if self._running:
            self._advance()
        self._poll_cache()
        return True

    def _next_queued(self) -> RequestHandle | None:
        """The head of the next tenant's queue (round-robin); called with the lock held."""
        while self._queues:
            tenant, queue = next(iter(self._queues.items()))
            handle = queue.popleft()
            del self._queues[tenant]
            if queue:
                self._queues[tenant] = queue  # back of the line
            return handle
        return None

    def _admit(self, item: RequestHandle | Sequence) -> None:
        handle = item.handle if isinstance(item, Sequence) else item
        if handle.cancelled and not isinstance(item, Sequence):
            self._end(handle, FinishEvent("cancelled", 0, None))
            return
        try:
            seq = self.engine.admit(item)
        except Exception as exc:  # one bad request must not stop the engine
            log.exception("admission failed for %s", handle.request.request_id)
            if isinstance(item, Sequence):
                self._close(item, "error", exc, running=False)
            else:
                self._end(handle, FinishEvent("error", 0, None, str(exc), type(exc).__name__))
            return
        self._running.append(seq)

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._running if s.handle.cancelled]:
            self._close(seq, "cancelled")

    def _advance(self) -> None:
        """One batched step; preempted sequences wait at the front, failed ones end."""
        result = self.engine.step(list(self._running))
        for seq in result.preempted:
            self._running.remove(seq)
        with self._lock:
            self._resume.extend(result.preempted)
        for seq, exc in result.failed:
            log.error("step failed for %s: %s", seq.request.request_id, exc)
            if seq in self._running:
                self._close(seq, "error", exc)
        for seq in list(self._running):
            self._finish_if_done(seq)

    def _finish_if_done(self, seq: Sequence) -> None:
        reason = self.engine.finished_reason(seq)
        if reason is not None:
            self._close(seq, reason)

    def _close(self, seq: Sequence, reason: str, error: Exception | None = None, *,
               running: bool = True) -> None:
        if running:
            self._running.remove(seq)
        # Counted before the submitter hears of the end: a client that reads /metrics after
        # its response sees its request there.
        self._count(reason)
        handle = seq.handle
        first = handle.first_token_at
        self.requests.observe(reason, seq.report, completion_tokens=seq.generated,
                              ttft_s=None if first is None else first - handle.submitted_at,
                              e2e_s=time.perf_counter() - handle.submitted_at,
                              token_gaps=handle.token_gaps)
        try:
            self.engine.finish(seq, reason, error)
        except Exception:
            log.exception("finish failed for %s", seq.request.request_id)
            if not seq.handle.done.is_set():
                seq.handle._emit(FinishEvent("error", seq.generated, seq.report, "finish failed"))

    def _end(self, handle: RequestHandle, event: FinishEvent) -> None:
        self._count(event.reason)
        self.requests.observe(event.reason, e2e_s=time.perf_counter() - handle.submitted_at)
        handle._emit(event)

    def _count(self, reason: str) -> None:
        with self._lock:
            self._pending -= 1
            key = {"error": "failed", "cancelled": "cancelled"}.get(reason, "finished")
            self.counters[key] += 1

    def _poll_cache(self) -> None:
        if self._poll is not None:
            try:
                self._poll()
            except Exception:
                log.exception("cache poll failed")

    def _drain(self) -> None:
        """Shutdown: end every running and queued request with a finish event."""
        self.calls.close()
        for seq in list(self._running):
            self._close(seq, "error", ShuttingDown())
        for seq in list(self._resume):
            self._close(seq, "error", ShuttingDown(), running=False)
        self._resume.clear()
        with self._lock:
            handles = [h for q in self._queues.values() for h in q]
            self._queues.clear()
        for handle in handles:
            self._end(handle, FinishEvent("error", 0, None, str(ShuttingDown()),
                                          ShuttingDown.__name__))
