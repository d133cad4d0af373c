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
faster than its disk, and only a read shows it). The scheduling thread runs it (under the
runtime's lock).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

#: Steps with fewer tokens are not timed: fixed per-step costs dominate them.
MIN_TIMED_TOKENS = 256
STORE_TIERS = ("disk", "remote")


class StepClock:
    """Times vLLM's steps from one ``build_connector_meta`` to the next. A step counts only
    when a request it ran runs again in the next one (the engine was busy in between, not
    idle) and it scheduled ``MIN_TIMED_TOKENS`` or more; ``observe(tokens, seconds)`` gets it
    (the cache's ``observe_prefill``: a line fit of seconds against tokens)."""

    def __init__(self) -> None:
        self._last: tuple[float, int, frozenset[str]] | None = None

    def step(self, now: float, tokens: int, requests: Iterable[str],
             observe: Callable[[int, float], None]) -> None:
        ran = frozenset(requests)
        if self._last is not None:
            started, last_tokens, last_ran = self._last
            if last_tokens >= MIN_TIMED_TOKENS and last_ran & ran and now > started:
                observe(last_tokens, now - started)
        self._last = (now, tokens, ran) if tokens else None


def store_part_pays(tokens_by_tier: dict[str, int], rates: Any,
                    bytes_per_token: int) -> bool | None:
    """True when reading the store tiers' part of a hit (``tokens_by_tier``) takes less time
    than vLLM computing those tokens, False when it takes longer, None when it is not known
    (no store part, no learnt prefill rate, or a tier never read here)."""
    stored = {t: tokens_by_tier.get(t, 0) for t in STORE_TIERS if tokens_by_tier.get(t, 0)}
    prefill = rates.prefill_tokens_per_s
    if not stored or not prefill or any(not rates.observed.get(t) for t in stored):
        return None
    read_s = max(rates.rates[t][1] for t in stored)
    read_s += sum(n * bytes_per_token / max(rates.rates[t][0], 1.0) for t, n in stored.items())
    return read_s < sum(stored.values()) / prefill


def priced_hit(cache: Any, hit: Any, prompt: list[int], salt: str | None) -> tuple[Any, int]:
    """``(hit, 0)``, or, when reading the part only a store holds was measured slower than
    vLLM computing it, the hit of the prompt's device and host part alone (matched again over
    that prefix, so nothing reads the store) and the tokens left out."""
    rates = getattr(getattr(cache, "controller", None), "rates", None)
    if rates is None:
        return hit, 0
    layout = cache.device_pool.layout
    if store_part_pays(hit.tokens_by_tier, rates,
                       layout.page_bytes // layout.page_size) is not False:
        return hit, 0
    fast = hit.tokens - sum(hit.tokens_by_tier.get(tier, 0) for tier in STORE_TIERS)
    return cache.match(prompt[:fast], salt), hit.tokens - fast
