"""``AdmitReturning``: the admission of ``write_through_selective`` (copy down what returns).

Owns the bounded memory of page identities seen by recent requests and the measured return
rate of the pages it refuses. A lower tier only pays for a page that a later request reads
after the device has lost it, and a page cannot be known to return before it does; the
request shapes that show it, and what each gets:

- *pages seen before* (a shared system prompt, a document, a conversation's history): they
  came back once already, so the matched prefix of seen pages is admitted (seen across
  evictions: a page the device dropped and the request recomputed still counts);
- *a continuation*: a request whose seen prefix ends in pages seen exactly once continues one
  earlier request (the next turn, the next agent step); the whole of it, its new pages too, is
  what that chain's next request reads, so all of it is admitted;
- *fresh pages* of any other request (a first turn, a one-off document, the new part after a
  shared head) are what is left. Whether they return depends on the workload (a first turn
  continues 28 % of the time on the Mooncake conversation trace and 85 % on the ``multiturn``
  synthetic shape), so it is measured: the first fresh page of each request is a *probe*,
  and it counts as returned if a later request reads it before ``memory`` new pages have been
  seen after it (past that a lower tier of that size would not hold it either). Every probe is
  resolved at that horizon, returned or not, so quick returns do not resolve ahead of the
  failures and bias the rate upwards. Fresh pages are admitted while the probes' decayed
  return rate is at least ``likely`` (default 1/2: "likely to return" in its plain sense, more
  often than not), once ``evidence`` probes are resolved. Before that (the first ``memory``
  new pages), the rate is bounded from below by counting every open probe that has not yet
  returned as failed, and fresh pages are admitted once that bound reaches ``likely`` over at
  least ``evidence`` probes: a workload whose first turns clearly return is served from the
  start, and nothing is admitted on a guess.

Engine thread only (the live ``HostWriter``) or the replay's main thread; no locking, no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvtier.index.eviction import AdmissionPolicy, Node, page_layout


class AdmitReturning(AdmissionPolicy):
    """Copy down pages seen before, whole continuations, and fresh pages while they return."""

    name = "returning"

    def __init__(self, memory: int = 1 << 18, likely: float = 0.5, half_life: float = 256.0,
                 evidence: float = 32.0) -> None:
        if memory < 1:
            raise ValueError(f"memory must be >= 1 page, got {memory}")
        if not 0.0 < likely <= 1.0 or half_life <= 0 or evidence < 0:
            raise ValueError("need 0 < likely <= 1, half_life > 0, evidence >= 0")
        self.memory = memory
        self.likely = likely
        self.evidence = evidence
        self._keep = 0.5 ** (1.0 / half_life)   # decay per resolved probe
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self._probes: OrderedDict[bytes, list[int]] = OrderedDict()  # key -> [born, returned]
        self._new_pages = 0                     # pages seen for the first time
        self._open_returned = 0                 # open probes that have returned
        self.returned = 0.0                     # decayed count of probes that returned
        self.resolved = 0.0                     # decayed count of probes resolved
        self.probes_total = 0
        self.fresh_admitted_pages = 0

    def admit(self, node: Node, hits: int) -> bool:
        buffer, step = page_layout(node)
        return hits >= 2 or (step > 0 and buffer[:step] in self._seen)

    @property
    def fresh_return_rate(self) -> float | None:
        """The resolved probes' decayed return rate; before ``evidence`` are resolved, its lower
        bound over resolved and open probes; None while there are fewer than ``evidence``."""
        if self.resolved >= self.evidence:
            return self.returned / self.resolved
        probes = self.resolved + len(self._probes)
        if probes < self.evidence:
            return None
        return (self.returned + self._open_returned) / probes

    def admits_fresh(self) -> bool:
        rate = self.fresh_return_rate
        return rate is not None and rate >= self.likely

    def admitted_pages(self, path: Sequence[tuple[Node, int]], limit: int,
                       observe: bool = True) -> int:
        """Pages to copy down from the root of one request's ``path``, at most ``limit``.
        ``observe`` records the request's pages as seen (once per request: a load that asks
        before its commit passes False)."""
        seen, probes = self._seen, self._probes
        pos = returning = 0
        private = False
        first_fresh: bytes | None = None
        for node, used in path:
            buffer, step = page_layout(node)
            for i in range(used if step else 0):
                key = buffer[i * step:(i + 1) * step]
                count = seen.pop(key, 0) if observe else seen.get(key, 0)
                if count and returning == pos:
                    returning += 1
                    private = count == 1
                elif first_fresh is None:       # where the seen prefix ends
                    first_fresh = key
                if observe:
                    if count == 0:
                        self._new_pages += 1
                    elif count == 1 and key in probes and not probes[key][1]:
                        probes[key][1] = 1
                        self._open_returned += 1
                    seen[key] = count + 1
                pos += 1
        base = pos if private and returning else returning
        admitted = pos if base < pos and self.admits_fresh() else base
        if observe:
            if base < pos and first_fresh is not None and first_fresh not in probes \
                    and seen.get(first_fresh) == 1:
                probes[first_fresh] = [self._new_pages, 0]
                self.probes_total += 1
            while len(seen) > self.memory:
                seen.popitem(last=False)
            horizon = self._new_pages - self.memory
            while probes:
                born, returned = next(iter(probes.values()))
                if born >= horizon:
                    break
                probes.popitem(last=False)
                self._open_returned -= returned
                self._resolve(bool(returned))
        admitted = min(limit, admitted)
        if observe and admitted > base:
            self.fresh_admitted_pages += admitted - base
        return admitted

    def _resolve(self, returned: bool) -> None:
        keep = self._keep
        self.returned = self.returned * keep + (1.0 if returned else 0.0)
        self.resolved = self.resolved * keep + 1.0

    def stats(self) -> dict[str, object]:
        return {"fresh_return_rate": self.fresh_return_rate, "admits_fresh": self.admits_fresh(),
                "probes_total": self.probes_total, "probes_open": len(self._probes),
                "fresh_admitted_pages": self.fresh_admitted_pages}
