"""Write policies: when device pages get a host copy (device -> host), then a store backup.

Owns ``HostWriter``. Policies (``controller.write_policy``):

- ``write_through``: every committed page gets a host copy at commit;
- ``write_through_selective``: a page gets one when it is likely to come back
  (``AdmitReturning``: pages seen before, the whole of a request that continues an earlier
  one, and fresh pages while probes show that most of them return), checked at commit (which
  records the request's pages as seen) and at every load (which only asks);
- ``write_back``: a page gets one when the device evicts it (the index's ``on_evict`` hook; the
  copy is waited for, since the device page is freed right after).

A host copy always extends the host tier's prefix (pages ``[host depth, end)``), so the host
tier stays prefix-closed. While a copy is in flight its device pages are locked on device, the
host prefix above it is locked on host, and its host pages belong to the copy (not the index);
on completion they are inserted (pages another copy already put there come back and are freed)
and the path is handed to ``Backups``. Completions are taken in submission order.

An engine that writes host pages itself (``fill``: an integration copying its own KV memory
straight into host pages) gets host pages past the host prefix the same way; its write's
ticket stands for the copy's, and the pages enter the index once it is done.

Engine thread only: the copy engine's tickets are polled, never waited on, except by write-back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.controller.backups import Backups
from kvtier.controller.context import CacheContext, path_of, split_keys
from kvtier.errors import PoolExhausted
from kvtier.index.admit_returning import AdmitReturning
from kvtier.index.eviction import AdmissionPolicy, AdmitAll
from kvtier.index.match import IndexMatch
from kvtier.index.residency import TIER_INDEX, Node

if TYPE_CHECKING:
    from kvtier.transfer.copy_engine import Ticket

HOST = TIER_INDEX["host"]
#: ``fill``'s writer: ``(first page, host page ids) -> ticket`` of the write it started.
HostFill = Callable[[int, list[int]], "Ticket"]


@dataclass
class HostCopy:
    """A device -> host copy in flight."""

    ticket: Ticket
    data: bytes
    salt: bytes
    keys: Sequence[bytes]
    lo: int
    host_ids: list[int]
    device_node: Node | None
    host_node: Node | None
    match: IndexMatch   # the walk of the prompt when the copy was submitted
    #: ``copy_tail``: the device pages outside the index the copy reads, freed once it is over.
    scratch: list[int] = field(default_factory=list)


class HostWriter:
    """Applies the write policy and completes device -> host copies."""

    def __init__(self, ctx: CacheContext, backups: Backups) -> None:
        self.ctx = ctx
        self.backups = backups
        self.policy = ctx.config.write_policy
        self.admission: AdmissionPolicy = (
            AdmitReturning() if self.policy == "write_through_selective" else AdmitAll())
        self.pending: deque[HostCopy] = deque()

    # ---- policy entry points -------------------------------------------------------------
    def after_commit(self, data: bytes, salt: bytes, keys: Sequence[bytes],
                     match: IndexMatch | None = None) -> None:
        """Apply the write policy to a committed prompt (``match``: a walk of it to reuse)."""
        if self.policy == "write_back" or not self.ctx.has_host:
            self.backups.want(data, salt, keys, match)
            return
        match = self._walk(data, salt, match)
        self.copy(data, salt, keys, self._admitted_depth(match), match=match)

    def after_load(self, data: bytes, salt: bytes, keys: Sequence[bytes],
                   match: IndexMatch | None = None) -> None:
        """A prefix was used again: the selective policy may now admit it."""
        if self.policy == "write_through_selective" and self.ctx.has_host:
            match = self._walk(data, salt, match)
            self.copy(data, salt, keys, self._admitted_depth(match, observe=False), match=match)

    def _walk(self, data: bytes, salt: bytes, match: IndexMatch | None) -> IndexMatch:
        index = self.ctx.index
        return index.match(data, salt) if match is None else index.current(match)

    def _admitted_depth(self, match: IndexMatch, observe: bool = True) -> int:
        return self.admission.admitted_pages(match.path, match.depth_of("device"), observe)

    def on_evict(self, node: Node, tier: str) -> None:
        """Index hook: under write-back, copy a device victim (and its path) to host first."""
        if tier != "device" or self.policy != "write_back" or not self.ctx.has_host:
            return
        if node.res[HOST] is not None:
            return
        data, raw_keys = path_of(node)
        self.copy(data, node.salt, split_keys(raw_keys), len(data) // self.ctx.step, wait=True)

    # ---- copies ------------------------------------------------------------------------------
    def copy(self, data: bytes, salt: bytes, keys: Sequence[bytes], stop: int, *,
             wait: bool = False, match: IndexMatch | None = None) -> int:
        """Copy device pages ``[host depth, stop)`` to host; returns the pages submitted."""
        ctx = self.ctx
        match = self._walk(data, salt, match)
        lo, hi = match.depth_of("host"), min(stop, match.depth_of("device"))
        if hi <= lo:
            return 0
        host_node, match = ctx.lock_on(match, lo, "host")
        device_node, match = ctx.lock_on(match, hi, "device")
        host_ids = self._host_pages(hi - lo)
        if not host_ids:
            ctx.unlock(host_node, "host")
            ctx.unlock(device_node, "device")
            return 0
        match = ctx.index.current(match)  # making room may have evicted host pages
        device_ids = match.ids("device", lo, lo + len(host_ids))
        assert ctx.copy is not None, "a host copy without a copy engine"
        ticket = ctx.copy.store(device_ids, host_ids)
        ctx.host_outside += len(host_ids)
        ctx.count("host_copy_pages_total", len(host_ids))
        record = HostCopy(ticket, data, salt, keys, lo, host_ids, device_node, host_node, match)
        if wait:
            ticket.wait(None)
            self._complete(record)
        else:
            self.pending.append(record)
            self.poll()
        return len(host_ids)

    def copy_tail(self, data: bytes, salt: bytes, keys: Sequence[bytes], first: int,
                  scratch_ids: Sequence[int], match: IndexMatch | None = None) -> int:
        """Copy pages ``[first, first + len(scratch_ids))`` of a prompt to host from device
        pages the index does not hold (``scratch_ids[i]`` holds page ``first + i``: a save's
        staging pages), extending the host tier's prefix; returns the pages submitted. The host
        tier must hold pages ``[0, first)`` (else nothing is copied: 0); pages it holds already
        are skipped (and count as submitted). Every scratch id is the writer's from here:
        freed now if not copied, else once the copy is over (counted in ``device_outside``
        meanwhile). ``match``: a walk of the prompt to reuse."""
        ctx, scratch = self.ctx, list(scratch_ids)
        match = self._walk(data, salt, match)
        lo, hi = match.depth_of("host"), first + len(scratch)
        if lo >= hi:                      # the host tier holds all of it already
            ctx.index.free("device", scratch)
            return len(scratch)
        if lo < first:                    # the head left the host tier
            ctx.index.free("device", scratch)
            return 0
        host_node, match = ctx.lock_on(match, lo, "host")     # the head stays while copying
        host_ids = self._host_pages(hi - lo)
        if not host_ids:
            ctx.unlock(host_node, "host")
            ctx.index.free("device", scratch)
            return 0
        used = scratch[lo - first:lo - first + len(host_ids)]
        ctx.index.free("device", scratch[:lo - first] + scratch[lo - first + len(host_ids):])
        match = ctx.index.current(match)  # making room may have evicted other host pages
        assert ctx.copy is not None, "a host copy without a copy engine"
        ticket = ctx.copy.store(used, host_ids)
        ctx.host_outside += len(host_ids)
        ctx.device_outside += len(used)
        ctx.count("host_copy_pages_total", len(host_ids))
        self.pending.append(HostCopy(ticket, data, salt, keys, lo, host_ids, None, host_node,
                                     match, used))
        self.poll()
        return lo - first + len(host_ids)

    def fill(self, data: bytes, salt: bytes, keys: Sequence[bytes], fill: HostFill,
             match: IndexMatch | None = None) -> int:
        """Extend the host tier's prefix of a prompt with pages the caller writes itself:
        ``fill(first, host_ids)`` must start writing pages ``[first, first + len(host_ids))``
        (its KV, in kvtier's page layout) into those host pages and return a ticket of that
        write; they enter the index once it is done (``poll``). Returns the pages of the prompt
        the host tier holds or will hold once the write is over (``first + len(host_ids)``, or
        its host depth when it held them all: nothing is written); 0 when the host tier had no
        room. A ``fill`` that raises gives the pages back and raises."""
        ctx = self.ctx
        match = self._walk(data, salt, match)
        lo, hi = match.depth_of("host"), len(keys)
        if lo >= hi:
            return lo
        host_node, match = ctx.lock_on(match, lo, "host")     # the head stays while writing
        host_ids = self._host_pages(hi - lo)
        if not host_ids:
            ctx.unlock(host_node, "host")
            return 0
        match = ctx.index.current(match)  # making room may have evicted other host pages
        try:
            ticket = fill(lo, host_ids)
        except BaseException:
            ctx.unlock(host_node, "host")
            ctx.index.free("host", host_ids)
            raise
        ctx.host_outside += len(host_ids)
        ctx.count("host_fill_pages_total", len(host_ids))
        self.pending.append(HostCopy(ticket, data, salt, keys, lo, host_ids, None, host_node,
                                     match))
        self.poll()
        return lo + len(host_ids)

    def _host_pages(self, wanted: int) -> list[int]:
        sizes = self.ctx.index.sizes("host")
        n = min(wanted, (sizes.free or 0) + sizes.evictable)
        if n < wanted:
            self.ctx.count("host_copy_short_pages_total", wanted - n)
        if n <= 0:
            return []
        try:
            return self.ctx.index.allocate("host", n)
        except PoolExhausted:
            self.ctx.count("host_copy_short_pages_total", n)
            return []

    def poll(self) -> None:
        """Complete finished copies, oldest first (stops at the first still in flight)."""
        while self.pending and self.pending[0].ticket.is_done():
            self._complete(self.pending.popleft())

    def drain(self) -> None:
        while self.pending:
            record = self.pending.popleft()
            record.ticket.wait(None)
            self._complete(record)

    def _complete(self, record: HostCopy) -> None:
        ctx = self.ctx
        n = len(record.host_ids)
        result = ctx.index.insert(record.data, record.keys, tier="host", ids=record.host_ids,
                                  start=record.lo, stop=record.lo + n, salt=record.salt,
                                  strict=False, after=record.match)
        ctx.index.free("host", result.unused_ids)
        ctx.host_outside -= n
        ctx.count("host_copy_dropped_pages_total", len(result.unused_ids))
        ctx.unlock(record.device_node, "device")
        ctx.unlock(record.host_node, "host")
        if record.scratch:
            ctx.device_outside -= len(record.scratch)
            ctx.index.free("device", record.scratch)
        self.backups.want(record.data, record.salt, record.keys, result.match)
