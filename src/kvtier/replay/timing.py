"""Policy overhead measurement: a transparent proxy that times every policy call.

Owns ``TimedPolicy``, which wraps any ``EvictionPolicy`` and accumulates wall time and call
counts per method (``add``, ``remove``, ``touch``, ``pop_victim``, ``forget``), so a replay can
report the cost of a policy per page operation beside LRU's (a cache hint's ``boost`` reaches
the policy untimed, so a timed replay serves what an untimed one does); the proxy's own cost (two
``perf_counter_ns`` reads per call) is measured once with an empty policy and subtracted. And
``RecordingPolicy`` + ``time_calls``: log the call stream a replay sends one policy, then re-run
it on fresh policies and keep the best of several runs (steadier on a busy machine).
Engine thread (the replay's main thread); no locking.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvtier.index.eviction import EvictionPolicy, Node

METHODS: tuple[str, ...] = ("add", "remove", "touch", "pop_victim", "forget")


class TimedPolicy(EvictionPolicy):
    """Forwards every call to ``inner`` and records how long it took."""

    def __init__(self, inner: EvictionPolicy) -> None:
        self.inner = inner
        self.name = inner.name
        self.supports_boost = inner.supports_boost
        self.calls = dict.fromkeys(METHODS, 0)
        self.nanos = dict.fromkeys(METHODS, 0)

    def _timed(self, method: str, *args: Any) -> Any:
        start = time.perf_counter_ns()
        out = getattr(self.inner, method)(*args)
        self.nanos[method] += time.perf_counter_ns() - start
        self.calls[method] += 1
        return out

    def add(self, node: Node, pages: int) -> None:
        self._timed("add", node, pages)

    def remove(self, node: Node) -> None:
        self._timed("remove", node)

    def touch(self, node: Node) -> None:
        self._timed("touch", node)

    def pop_victim(self) -> Node | None:
        return self._timed("pop_victim")

    def forget(self, node: Node) -> None:
        self._timed("forget", node)

    def boost(self, node: Node, pages: float) -> None:
        self.inner.boost(node, pages)

    def __len__(self) -> int:
        return len(self.inner)

    def report(self, probe_ns: float) -> dict[str, Any]:
        """Calls and mean microseconds per call of each method, less the proxy's own cost."""
        out: dict[str, Any] = {}
        total_calls = sum(self.calls.values())
        total_ns = sum(self.nanos.values()) - probe_ns * total_calls
        for method in METHODS:
            n = self.calls[method]
            mean = (self.nanos[method] / n - probe_ns) if n else 0.0
            out[method] = {"calls": n, "us_per_call": max(mean, 0.0) / 1e3}
        out["all"] = {"calls": total_calls,
                      "us_per_call": max(total_ns, 0.0) / 1e3 / max(total_calls, 1)}
        return out


class _Null(EvictionPolicy):
    name = "null"

    def add(self, node: Node, pages: int) -> None:
        pass

    def remove(self, node: Node) -> None:
        pass

    def touch(self, node: Node) -> None:
        pass

    def pop_victim(self) -> Node | None:
        return None

    def __len__(self) -> int:
        return 0


def proxy_cost_ns(calls: int = 20000) -> float:
    """Mean nanoseconds the proxy adds to one call (timed against a policy that does nothing)."""
    probe = TimedPolicy(_Null())
    for i in range(calls):
        probe.touch(i)
    return probe.nanos["touch"] / calls


class RecordingPolicy(EvictionPolicy):
    """Forwards every call to ``inner`` and logs it, so the same call stream can be re-run
    against a fresh policy and timed without the index around it (``time_calls``)."""

    def __init__(self, inner: EvictionPolicy) -> None:
        self.inner = inner
        self.name = inner.name
        self.supports_boost = inner.supports_boost
        self.log: list[tuple[str, tuple[Any, ...]]] = []

    def add(self, node: Node, pages: int) -> None:
        self.log.append(("add", (node, pages)))
        self.inner.add(node, pages)

    def remove(self, node: Node) -> None:
        self.log.append(("remove", (node,)))
        self.inner.remove(node)

    def touch(self, node: Node) -> None:
        self.log.append(("touch", (node,)))
        self.inner.touch(node)

    def pop_victim(self) -> Node | None:
        self.log.append(("pop_victim", ()))
        return self.inner.pop_victim()

    def forget(self, node: Node) -> None:
        self.log.append(("forget", (node,)))
        self.inner.forget(node)

    def boost(self, node: Node, pages: float) -> None:
        self.log.append(("boost", (node, pages)))
        self.inner.boost(node, pages)

    def __len__(self) -> int:
        return len(self.inner)


def time_calls(log: list[tuple[str, tuple[Any, ...]]], factory: Callable[[], EvictionPolicy],
               repeats: int = 5) -> dict[str, float]:
    """Re-run ``log`` on fresh policies from ``factory``; the best of ``repeats`` runs, as
    microseconds per call and milliseconds in all."""
    best = float("inf")
    for _ in range(repeats):
        policy = factory()
        calls = [(getattr(policy, method), args) for method, args in log]
        start = time.perf_counter_ns()
        for call, args in calls:
            call(*args)
        best = min(best, time.perf_counter_ns() - start)
    return {"calls": len(log), "us_per_call": best / 1e3 / max(len(log), 1),
            "total_ms": best / 1e6}
