"""The connector's background thread: stores prompts off vLLM's forward, at idle CPU priority.

Owns ``Saver``. The model runner (on the CPU backend) or the scheduler (a finished request's
generated pages) ``submit``s a ``SaveSpec``; with workers in processes of their own the
scheduler submits a ``PromptSave`` the ranks already copied. The saver thread plans, copies
layer by layer and commits it through the bound ``SaveCopier`` (``saves``). The queue is bounded
(``save_queue_depth``): past it a save is dropped and counted, never waited for. The thread
lowers itself to ``SCHED_IDLE`` (``background_priority: idle``) before anything else, and
``call`` runs the cache's construction on it, so kvtier's IO threads inherit that class too:
on a CPU backend, where vLLM's forward takes every core, kvtier then only uses cycles vLLM
leaves idle. Its torch ops run on it alone (``one_torch_thread``), never over an OpenMP team
whose members would spin waiting for each other.

While a save still reads vLLM's blocks, vLLM must not reuse them:

- ``request_finished`` asks ``hold_blocks(req_id)``: True while a save of that request has not
  finished copying (vLLM then keeps the blocks), and ``take_released(finished_ids)`` reports
  such requests once their copy is over (``get_finished``'s sending set);
- ``cancel(req_ids)`` (vLLM preempted them, and their blocks go back to the pool before the next
  forward) marks their saves cancelled and returns only once no layer of them is being copied.

Threads: the saver thread runs jobs; ``submit``/``cancel``/``take_released`` come from the model
runner, ``hold_blocks`` from the scheduler. One condition variable guards the queue and the
block-holding sets; ``_copying`` is held while one layer is copied.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from kvtier.errors import ConfigError

log = logging.getLogger(__name__)
T = TypeVar("T")

PRIORITIES = ("idle", "normal")


def check_priority(priority: str) -> None:
    """Refuse a ``background_priority`` this platform cannot apply."""
    if priority not in PRIORITIES:
        raise ConfigError("background_priority", priority, " or ".join(PRIORITIES))
    if priority == "idle" and not hasattr(os, "SCHED_IDLE"):
        raise ConfigError("background_priority", priority,
                          "normal on this platform (it has no SCHED_IDLE scheduling class)")


def _lower_this_thread(priority: str) -> None:
    if priority == "idle":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))   # 0: the calling thread


def one_torch_thread() -> None:
    """Run the calling thread's torch CPU ops on that thread alone, leaving every other
    thread's count as it was.

    torch runs a CPU op over an OpenMP team; a team member that finds its partners descheduled
    spins at the op's barrier. On a CPU backend vLLM's forward holds every core, so a save's
    copies run with their partners preempted: measured on 2 cores, the saver's gathers spent 10x
    their single-threaded CPU time spinning (``benchmarks/vllm/vllm_write_path.py``).

    OpenMP keeps the team size per thread, so this sets the calling thread's alone, through the
    OpenMP runtimes the process has loaded. Not ``torch.set_num_threads``: besides this
    thread's team it rewrites process-wide state (the count threads started later take up,
    MKL's and the pthreadpool's sizes) while vLLM's own threads run. torch's one-time set-up of
    a thread (which would put its count back) runs first, through ``get_num_threads``.
    """
    import torch

    torch.get_num_threads()
    runtimes = _openmp_runtimes()
    for runtime in runtimes:
        runtime.omp_set_num_threads(1)
    if not runtimes:
        log.debug("kvtier: no OpenMP runtime loaded; the saver's torch ops keep torch's count")


def _openmp_runtimes() -> list[Any]:
    """The OpenMP runtimes loaded in this process (the one symbols resolve to first, then any
    other a library brought, such as torch's own libgomp): each keeps its own per-thread
    counts."""
    import ctypes
    import re

    found: list[Any] = []
    try:
        first = ctypes.CDLL(None)
        if hasattr(first, "omp_set_num_threads"):
            found.append(first)
    except OSError:
        pass
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps
                            if re.search(r"/lib(gomp|iomp5|omp)[^/]*\.so", line)})
    except OSError:
        paths = []
    for path in paths:
        try:
            found.append(ctypes.CDLL(path))
        except OSError:
            continue
    return [lib for lib in found if hasattr(lib, "omp_set_num_threads")]


@dataclass(eq=False)
class _Job:
    """One queued save: a ``SaveSpec`` still to plan, or a ``PromptSave``."""

    req_id: str
    spec: Any = None
    save: Any = None
    handles: list[Any] | None = None     # the request's loads, released by the save
    cancelled: bool = False


class Saver:
    """See the module docstring. ``copier`` is bound once vLLM registers its KV tensors."""

    def __init__(self, depth: int, priority: str = "idle", name: str = "kvtier-vllm-saver") -> None:
        check_priority(priority)
        self.depth = depth
        self.priority = priority
        self.copier: Any = None
        self.counts: Counter[str] = Counter()
        self._cond = threading.Condition()
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self._jobs: deque[_Job] = deque()
        self._reading: dict[str, list[_Job]] = {}    # request id -> its saves still reading
        self._held: set[str] = set()                 # requests vLLM keeps blocks for
        self._released: set[str] = set()             # held requests whose copies ended
        self._copying = threading.Lock()
        self._busy = False
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ---- from other threads ----------------------------------------------------------------
    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the saver thread and return its result (or raise its exception)."""
        future: Future = Future()
        with self._cond:
            self._calls.append((fn, future))
            self._cond.notify()
        return future.result()

    def submit(self, req_id: str, spec: Any = None, save: Any = None,
               handles: list[Any] | None = None) -> bool:
        """Queue a ``SaveSpec`` to plan and copy (``handles``: loads the save releases), or a
        ``PromptSave`` the forward copied; False (counted ``saves_dropped_queue_full``, and
        nothing queued) when the queue is full."""
        job = _Job(req_id, spec, save, handles)
        with self._cond:
            if self._closing or len(self._jobs) >= self.depth:
                self.counts["saves_dropped_queue_full"] += 1
                return False
            self._jobs.append(job)
            if save is None or save.layers_copied < self.copier.num_layers:
                self._reading.setdefault(req_id, []).append(job)
            self.counts["saves_queued"] += 1
            self._cond.notify()
            return True

    def hold_blocks(self, req_id: str) -> bool:
        """Whether vLLM must keep ``req_id``'s blocks (a save still reads them)."""
        with self._cond:
            if req_id in self._reading:
                self._held.add(req_id)
                return True
            return False

    def take_released(self, finished: Iterable[str]) -> set[str]:
        """Held requests whose saves stopped reading their blocks (among ``finished``, the
        requests vLLM has told the worker are finished, so far)."""
        with self._cond:
            out = self._released & set(finished)
            self._released -= out
            return out

    def cancel(self, req_ids: Iterable[str]) -> None:
        """Stop saves of ``req_ids`` from reading their blocks; returns once none does."""
        with self._cond:
            cancelled = [job for r in req_ids for job in self._reading.get(r, ())]
            for job in cancelled:
                job.cancelled = True
            self.counts["saves_cancelled"] += len(cancelled)
        if cancelled:
            with self._copying:         # waits out a layer being copied right now
                pass

    def drain(self, timeout_s: float) -> bool:
        """Wait until no save is queued or running; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._jobs or self._calls or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def close(self, timeout_s: float) -> None:
        self.drain(timeout_s)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    # ---- the saver thread ------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            _lower_this_thread(self.priority)
        except OSError as exc:          # should not happen on Linux; keep saving regardless
            log.warning("kvtier: cannot lower the saver thread's priority: %s", exc)
        one_torch_thread()
        while True:
            with self._cond:
                while not self._calls and not self._jobs and not self._closing:
                    self._cond.wait()
                if self._calls:
                    call, job = self._calls.popleft(), None
                elif self._jobs:
                    call, job = None, self._jobs.popleft()
                else:
                    return
                self._busy = True
            try:
                if call is not None:
                    _run_call(*call)
                else:
                    self._run(job)
            except Exception:           # one bad save must not stop the thread
                log.exception("kvtier: a prompt save failed")
                with self._cond:
                    self.counts["saves_failed"] += 1
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _run(self, job: _Job) -> None:
        copier = self.copier
        if copier is None:              # vLLM registered no KV tensors: nothing to copy from
            self._stop_reading(job)
            with self._cond:
                self.counts["saves_without_kv_tensors"] += 1
            return
        try:
            if job.save is None and not job.cancelled:
                job.save = copier.plan(job.spec, job.handles)
            elif job.save is None:
                copier.release(job.handles or [])
            if job.save is not None:
                self._copy_layers(job)
        finally:
            self._stop_reading(job)
        if job.save is None:
            return
        if job.cancelled:
            copier.abandon(job.save)
        else:
            copier.commit(job.save)

    def _copy_layers(self, job: _Job) -> None:
        for layer in range(job.save.layers_copied, self.copier.num_layers):
            with self._copying:
                if job.cancelled:
                    return
                self.copier.copy_layer(job.save, layer)

    def _stop_reading(self, job: _Job) -> None:
        with self._cond:
            jobs = self._reading.get(job.req_id, [])
            if job in jobs:
                jobs.remove(job)
            if not jobs:
                self._reading.pop(job.req_id, None)
                if job.req_id in self._held:
                    self._held.discard(job.req_id)
                    self._released.add(job.req_id)


def _run_call(fn: Callable[[], Any], future: Future) -> None:
    try:
        future.set_result(fn())
    except BaseException as exc:    # handed to the caller, raised there
        future.set_exception(exc)
