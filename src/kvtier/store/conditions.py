"""What is wrong with one store now, judged from its health probes and its counters.

Owns ``Conditions``: a store guard's thread feeds it each tick's ``Probe`` and the store's
lifetime counters; it keeps the active problems (one per reason) and says which got new
evidence this tick (to log and count) and which ended. Reasons:

- whatever the probe reports (``unreachable``, ``gone``, ``io_errors``): active while it says so;
- ``full``: writes refused without an IO error (a cap or free-space floor the store cannot
  evict its way under, a Redis server out of memory); ends with the next write that lands;
- ``io_errors``: pages that failed with an IO error (not counted while the probe already says
  the server is unreachable); ``corrupt_pages``: pages that failed verification. Each ends once
  pages are served or written again without one, or after ``HOLD_S`` without new evidence.

Pure bookkeeping, no IO and no locks: only the guard's thread calls it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvtier.store.base import Probe

#: Counters compared from tick to tick.
WATCHED = ("hits", "corrupt", "refused", "errors", "bytes_written")
#: Seconds a counter-judged problem (IO errors, corrupt pages) stays without new evidence when
#: no traffic shows the store well again.
HOLD_S = 60.0


@dataclass(frozen=True)
class Problem:
    reason: str
    message: str
    since: float  # when this problem started (the guard's clock)
    last: float   # when it last had evidence


class Conditions:
    """Active problems of one store; see the module docstring."""

    def __init__(self) -> None:
        self.active: dict[str, Problem] = {}
        self.seen_total: Counter[str] = Counter()  # ticks with evidence, per reason
        self._last: dict[str, int] | None = None

    def observe(self, probe: Probe, counters: dict[str, int], now: float,
                interval_s: float) -> tuple[list[Problem], list[Problem]]:
        """One tick: returns (problems with new evidence, problems that ended)."""
        d = self._deltas(counters)
        evidence = self._evidence(probe, d, interval_s)
        ended = []
        for reason, problem in list(self.active.items()):
            if reason not in evidence and self._over(problem, d, now):
                ended.append(self.active.pop(reason))
        fresh = []
        for reason, message in evidence.items():
            before = self.active.get(reason)
            problem = Problem(reason, message, before.since if before else now, now)
            self.active[reason] = problem
            self.seen_total[reason] += 1
            fresh.append(problem)
        return fresh, ended

    def clear(self) -> list[Problem]:
        """Forget every problem (the store behind them is gone); returns them."""
        ended, self.active = list(self.active.values()), {}
        self._last = None
        return ended

    def _deltas(self, counters: dict[str, int]) -> dict[str, int]:
        now = {name: int(counters.get(name, 0)) for name in WATCHED}
        last, self._last = self._last, now
        if last is None:
            return dict.fromkeys(WATCHED, 0)
        return {name: max(0, now[name] - last[name]) for name in WATCHED}

    @staticmethod
    def _evidence(probe: Probe, d: dict[str, int], interval_s: float) -> dict[str, str]:
        span = f"in the last {interval_s:.0f} s"
        out: dict[str, str] = {}
        if probe.problem:
            out[probe.reason or "unavailable"] = probe.problem
        full = d["refused"] - d["errors"]
        if full > 0:
            out["full"] = (f"{full} page writes refused {span} without an IO error: the store is "
                           "full and cannot evict its way under its limits"
                           + (f" ({probe.detail})" if probe.detail else "")
                           + "; raise its cap, free space, or lower its free-space floor")
        if d["errors"] and probe.reason != "unreachable":
            out.setdefault("io_errors", f"{d['errors']} pages failed with IO errors {span}"
                           + (f" ({probe.detail})" if probe.detail else ""))
        if d["corrupt"]:
            out["corrupt_pages"] = (f"{d['corrupt']} pages failed verification {span} (counted "
                                    "as misses, never served)")
        return out

    @staticmethod
    def _over(problem: Problem, d: dict[str, int], now: float) -> bool:
        reason = problem.reason
        if reason == "full":
            return d["bytes_written"] > 0
        if reason in ("io_errors", "corrupt_pages"):
            served = d["hits"] + d["bytes_written"] > 0
            return served or now - problem.last >= HOLD_S
        return True  # the probe reported it and no longer does
