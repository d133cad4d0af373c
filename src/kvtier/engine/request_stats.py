"""Request-level counters of the engine: prompt, cached and computed tokens, outcomes, latencies
(time to first token, queue, prefill, end to end, and the gap between a request's tokens).

Owns ``RequestStats`` (what every finished request adds up to) and ``LatencyHistogram`` (fixed
bucket bounds, plain counts; ``kvtier.metrics`` renders it as a Prometheus histogram). The
scheduler calls ``observe`` on the engine thread when a request ends; ``snapshot`` may be called
from any thread (one lock). Plain Python, no torch, no prometheus_client.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from typing import Any

TIERS = ("device", "host", "disk", "remote")

#: Seconds; spans a cached 1k-token prompt on a GPU (ms) to a 32k recompute on a CPU (minutes).
LATENCY_BOUNDS_S: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                                       10.0, 30.0, 60.0, 120.0)
#: Seconds between two tokens of one request: a decode step on a GPU (a few ms) to a CPU step
#: beside a long prefill chunk (seconds).
TOKEN_GAP_BOUNDS_S: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15,
                                         0.3, 0.6, 1.0, 2.5, 5.0)


class LatencyHistogram:
    """Counts of observations per bucket (``value <= bound``), their sum and count. Not locked:
    ``RequestStats`` holds its lock around every call."""

    def __init__(self, bounds: Sequence[float] = LATENCY_BOUNDS_S) -> None:
        if list(bounds) != sorted(set(bounds)) or not bounds:
            raise ValueError(f"bucket bounds must be increasing and distinct, got {bounds}")
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)   # the last bucket is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        value = max(0.0, float(value))
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def merge(self, other: LatencyHistogram) -> None:
        """Add ``other``'s observations (same bounds)."""
        if other.bounds != self.bounds:
            raise ValueError("histograms with different bounds")
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.total += other.total

    def snapshot(self) -> dict[str, Any]:
        """``{"bounds": [...], "counts": [... one per bound, then +Inf], "sum", "count"}``
        (counts per bucket, not cumulative)."""
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.total,
                "count": sum(self.counts)}


class RequestStats:
    """Totals over finished requests; see the module docstring."""

    def __init__(self, bounds: Sequence[float] = LATENCY_BOUNDS_S) -> None:
        self._lock = threading.Lock()
        self._outcomes: dict[str, int] = {}
        self._tokens = {"prompt": 0, "computed": 0, "recomputed_hit": 0, "completion": 0}
        self._cached = dict.fromkeys(TIERS, 0)
        self._ttft = LatencyHistogram(bounds)
        self._queue = LatencyHistogram(bounds)
        self._prefill = LatencyHistogram(bounds)
        self._e2e = LatencyHistogram(bounds)
        self._token_gaps = LatencyHistogram(TOKEN_GAP_BOUNDS_S)

    def observe(self, outcome: str, report: Any = None, *, completion_tokens: int = 0,
                ttft_s: float | None = None, e2e_s: float | None = None,
                token_gaps: LatencyHistogram | None = None) -> None:
        """One request ended with ``outcome`` (stop, length, cancelled, error). ``report`` is
        its ``PrefillReport`` (None when it never reached prefill); ``ttft_s`` the time from
        submission to its first token (None when it produced none); ``e2e_s`` from submission
        to its end; ``token_gaps`` the gaps between its tokens (``TOKEN_GAP_BOUNDS_S``)."""
        with self._lock:
            self._outcomes[outcome] = self._outcomes.get(outcome, 0) + 1
            self._tokens["completion"] += max(0, int(completion_tokens))
            if ttft_s is not None:
                self._ttft.observe(ttft_s)
            if e2e_s is not None:
                self._e2e.observe(e2e_s)
            if token_gaps is not None:
                self._token_gaps.merge(token_gaps)
            if report is None:
                return
            self._tokens["prompt"] += report.prompt_tokens
            self._tokens["computed"] += report.computed_tokens
            self._tokens["recomputed_hit"] += report.recomputed_hit_tokens
            for tier, tokens in report.cached_by_tier.items():
                self._cached[tier] = self._cached.get(tier, 0) + int(tokens)
            self._queue.observe(report.queue_s)
            self._prefill.observe(report.prefill_s)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"requests_total": dict(self._outcomes),
                    "prompt_tokens_total": self._tokens["prompt"],
                    "computed_tokens_total": self._tokens["computed"],
                    "recomputed_hit_tokens_total": self._tokens["recomputed_hit"],
                    "completion_tokens_total": self._tokens["completion"],
                    "cached_tokens_total": dict(self._cached),
                    "ttft_seconds": self._ttft.snapshot(),
                    "queue_seconds": self._queue.snapshot(),
                    "prefill_seconds": self._prefill.snapshot(),
                    "e2e_seconds": self._e2e.snapshot(),
                    "token_gap_seconds": self._token_gaps.snapshot()}
