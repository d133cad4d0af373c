"""The direct path's part of each step on the worker (connector key ``"direct": true``).

Owns ``DirectSteps``: what the worker half does with a step's loads and saves when they move
between vLLM's blocks and kvtier's host pages (``direct.DirectCopies``) beside the forward
rather than inside it:

- ``start_loads`` queues each load and ``take_received`` names the requests whose load is over
  (their held host pages go back) or failed (reported as load errors too, so vLLM recomputes
  them): vLLM schedules a request that waited for its load once it is named;
- ``saves`` queues the step's saves after the forward, and ``released`` names the finished
  requests whose blocks vLLM kept (the step's ``held`` mark) once their last save has read them;
- ``preempted`` makes the forward's stream wait for the saves still reading a preempted
  request's blocks, which vLLM reuses in this step.

Runs on vLLM's model-runner thread; ``WorkerSide`` calls it from vLLM's hooks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from kvtier.integrations.vllm.direct import DirectCopies, Ticket
from kvtier.integrations.vllm.specs import LoadSpec

log = logging.getLogger(__name__)


class DirectSteps:
    """See the module docstring. ``fail_load(spec, held)`` reports a load's blocks as load
    errors (and gives ``held`` back); ``save_failed(req_id)`` counts and logs a save that
    raised."""

    def __init__(self, runtime: Any, copies: DirectCopies,
                 fail_load: Callable[[LoadSpec, Any], None],
                 save_failed: Callable[[str], None]) -> None:
        self.runtime = runtime
        self.copies = copies
        self._fail_load = fail_load
        self._save_failed = save_failed
        #: Loads in flight (ticket, held host pages) by request; requests whose load is over
        #: or failed, for ``take_received``; the last save's ticket of each running request;
        #: finished requests whose blocks vLLM keeps until that ticket.
        self._receiving: dict[str, tuple[Ticket, Any]] = {}
        self._received: set[str] = set()
        self._saving: dict[str, Ticket] = {}
        self._releasing: dict[str, Ticket | None] = {}

    # ---- loads -------------------------------------------------------------------------------
    def start_loads(self, specs: Iterable[LoadSpec]) -> None:
        for spec in specs:
            self._start(spec)

    def _start(self, spec: LoadSpec) -> None:
        """Queue one load; a hit no longer held, or a copy that raised, is failed at once."""
        held = self.runtime.take_staged(spec.req_id)
        if held is None or held.tokens < spec.end:
            self._fail_load(spec, held)
            self._received.add(spec.req_id)
            return
        try:
            ticket = self.copies.load(spec, held)
        except Exception:
            log.exception("kvtier connector: loading request %s failed; vLLM recomputes it",
                          spec.req_id)
            self._fail_load(spec, held)
            self._received.add(spec.req_id)
            return
        held.ticket = ticket            # its host pages stay pinned until the copy is over
        self._receiving[spec.req_id] = (ticket, held)
        self.runtime.counts["loads_async"] += 1

    def take_received(self) -> set[str] | None:
        """Requests whose load is over (their held pages go back) or failed."""
        done = [req for req, (ticket, _) in self._receiving.items() if ticket.is_done()]
        if done:
            with self.runtime.lock:
                for req in done:
                    self.runtime.cache.release(self._receiving.pop(req)[1])
        received, self._received = self._received | set(done), set()
        return received or None

    # ---- saves -------------------------------------------------------------------------------
    def saves(self, meta: Any) -> None:
        """Queue the step's saves beside the forward; mark the step's ``held`` requests to be
        released once their last save is over."""
        # Oldest first: the copies run in order on one stream, so the first one still running
        # ends the scan (a step does not query every running request's event).
        while self._saving:
            req, ticket = next(iter(self._saving.items()))
            if not ticket.is_done():
                break
            del self._saving[req]
        for spec in meta.saves if meta is not None else ():
            try:
                ticket = self.copies.save(spec)
            except Exception:
                self._save_failed(spec.req_id)
                continue
            self._saving.pop(spec.req_id, None)          # to the end: the newest copy
            self._saving[spec.req_id] = ticket
        for req in meta.held if meta is not None else ():
            self._releasing[req] = self._saving.pop(req, None)

    def released(self) -> set[str]:
        """Finished requests whose blocks may go back to vLLM now (each named once)."""
        done = {req for req, ticket in self._releasing.items()
                if ticket is None or ticket.is_done()}
        for req in done:
            del self._releasing[req]
        return done

    def preempted(self, req_ids: Iterable[str]) -> None:
        """vLLM reuses these requests' blocks in this step: the forward waits for the saves
        still reading them (on the device, not the host)."""
        for req in req_ids:
            ticket = self._saving.pop(req, None)
            if ticket is not None and not ticket.is_done():
                ticket.stream_wait(self.copies.device)
