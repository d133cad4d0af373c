"""Whether the part of a hit only a store holds is worth waiting for inside vLLM.

Owns ``StepClock`` (vLLM's prefill rate, learnt from the steps the scheduler half sees),
``store_part_pays`` and ``priced_hit``. kvtier's own engine recomputes a hit's head while
its tail loads from a store, so a slow store still shortens the prefill there; inside vLLM the
claimed tokens must have landed before vLLM computes the rest, so a store's part pays only if
reading it takes less time than vLLM would take to compute those tokens. On a disk that reads
1.6 GB/s an 8B model's KV arrives at about 12,000 tokens a second, where vLLM on an H100
computes about 28,000: there a disk hit waited for its pages and then computed the rest, slower
than recomputing it all (``benchmarks/results/vllm_gpu_h100_miss_disk.txt``).

The decision is made only from measurements: a prefill rate the clock has learnt and, for each
store tier in the part, a read rate observed on this process's own reads (``RateBook.observed``);
with either missing the part is claimed as before (a store in the OS page cache can read far
faster than its disk, and only a read shows it). A part is declined only when its read would
take more than ``DECLINE_FACTOR`` times vLLM's compute: the clock's rate is an average over
mixed steps (a prompt's last tokens, where a store's part sits, cost more than the average
under attention), so an error either way falls on the side of reading, what the connector did
before it priced. The scheduling thread runs all of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

#: Steps with fewer tokens are not timed: fixed per-step costs dominate them.
MIN_TIMED_TOKENS = 256
#: A store's part is declined when reading it takes this many times vLLM's compute or more.
DECLINE_FACTOR = 1.5
#: Weight of a new step in the clock's running sums (older steps fade).
DECAY = 0.9
STORE_TIERS = ("disk", "remote")


class StepClock:
    """vLLM's tokens per second over its busy steps, timed from one ``build_connector_meta``
    to the next. A step is timed only inside a run of busy steps, from its second step on:
    a request it ran runs again in the next step (the engine did not idle in between), and
    the step before it was busy too (with asynchronous scheduling vLLM schedules the first two
    steps of a run back to back, so the first interval is not a step's time). Steps of fewer
    than ``MIN_TIMED_TOKENS`` tokens are not timed."""

    def __init__(self) -> None:
        self._last: tuple[float, int, frozenset[str]] | None = None
        self._run = 0                     # consecutive busy steps before the last one
        self._tokens = 0.0
        self._seconds = 0.0

    @property
    def tokens_per_s(self) -> float | None:
        return self._tokens / self._seconds if self._seconds > 0 else None

    def step(self, now: float, tokens: int, requests: Iterable[str]) -> None:
        ran = frozenset(requests)
        last = self._last
        busy = last is not None and bool(last[2] & ran) and now > last[0]
        if busy and last is not None:
            if self._run >= 1 and last[1] >= MIN_TIMED_TOKENS:
                self._tokens = self._tokens * DECAY + last[1]
                self._seconds = self._seconds * DECAY + (now - last[0])
            self._run += 1
        else:
            self._run = 0
        self._last = (now, tokens, ran) if tokens else None


def store_part_pays(tokens_by_tier: dict[str, int], rates: Any, prefill_tokens_per_s:
                    float | None, bytes_per_token: int) -> bool | None:
    """False when reading the store tiers' part of a hit (``tokens_by_tier``) would take
    ``DECLINE_FACTOR`` times vLLM computing those tokens or more, True when less, None when it
    is not known (no store part, no prefill rate, or a tier never read here)."""
    stored = {t: tokens_by_tier.get(t, 0) for t in STORE_TIERS if tokens_by_tier.get(t, 0)}
    if not stored or not prefill_tokens_per_s or any(not rates.observed.get(t) for t in stored):
        return None
    read_s = max(rates.rates[t][1] for t in stored)
    read_s += sum(n * bytes_per_token / max(rates.rates[t][0], 1.0) for t, n in stored.items())
    return read_s < DECLINE_FACTOR * sum(stored.values()) / prefill_tokens_per_s


def priced_hit(cache: Any, hit: Any, prompt: list[int], salt: str | None,
               prefill_tokens_per_s: float | None) -> tuple[Any, int]:
    """``(hit, 0)``, or, when reading the part only a store holds does not pay, the hit of the
    prompt's device and host part alone (matched again over that prefix, so nothing reads the
    store) and the tokens left out."""
    rates = getattr(getattr(cache, "controller", None), "rates", None)
    if rates is None:
        return hit, 0
    layout = cache.device_pool.layout
    if store_part_pays(hit.tokens_by_tier, rates, prefill_tokens_per_s,
                       layout.page_bytes // layout.page_size) is not False:
        return hit, 0
    fast = hit.tokens - sum(hit.tokens_by_tier.get(tier, 0) for tier in STORE_TIERS)
    return cache.match(prompt[:fast], salt), hit.tokens - fast
