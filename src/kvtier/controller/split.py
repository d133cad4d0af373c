"""Load or recompute: how many of a hit's tokens the engine should recompute (``plan_split``).

Owns ``RateBook`` (what each tier delivers and how fast the model prefills) and ``plan_split``.
The cost model is the planner's (``kvtier.planner.split_hit``): recompute the head of the hit
while its tail loads, so both finish together. The device part of a hit costs nothing to use,
so the split is taken only if recomputing reaches past it and beats loading the whole
non-device part; a hit whose loading is slower than recomputing all of it comes back as "all".

Rates start from the figures measured on our machines (``docs/architecture.md``) and follow
what this cache observes: every finished prefetch and load-back updates its tier's rate (an
exponential average), and the engine reports its prefill rate (``observe_prefill``). Until a
prefill rate is known the split is 0 (load everything: from RAM loading wins outright).
Engine thread only; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.controller.handles import Hit
from kvtier.planner import load_tokens_per_s, split_hit

#: Starting read rates (bytes/s) and first-byte latencies (s) per tier, before measurements.
DEFAULT_RATES: dict[str, tuple[float, float]] = {
    "host": (50e9, 0.0),        # pinned host -> device through UVA kernels (H200 machine)
    "disk": (1.5e9, 200e-6),    # cold local NVMe, 1-32 threads
    "remote": (1.0e9, 500e-6),  # Redis on loopback, pipelined
}
CPU_HOST_RATE = 5e9            # host -> "device" copies when the device is the CPU
SMOOTHING = 0.2


@dataclass
class RateBook:
    """Per-tier read rates and latencies, and the model's prefill rate (tokens/s)."""

    rates: dict[str, tuple[float, float]] = field(default_factory=lambda: dict(DEFAULT_RATES))
    prefill_tokens_per_s: float | None = None

    @classmethod
    def for_device(cls, device: str) -> RateBook:
        book = cls()
        if not str(device).startswith("cuda"):
            book.rates["host"] = (CPU_HOST_RATE, 0.0)
        return book

    def observe(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        rate, latency = self.rates[tier]
        self.rates[tier] = (rate + SMOOTHING * (nbytes / seconds - rate), latency)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        seen = tokens / seconds
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = seen if old is None else old + SMOOTHING * (seen - old)


def plan_split(hit: Hit, book: RateBook, bytes_per_token: int) -> int:
    """Tokens at the head of ``hit`` to recompute rather than load (a page multiple)."""
    prefill = book.prefill_tokens_per_s
    page = hit.page_size
    device_tokens = hit.reach("device") * page
    if not prefill or hit.tokens <= device_tokens:
        return 0
    load_s, latency = 0.0, 0.0
    for tier in ("host", "disk", "remote"):
        tokens = hit.tokens_by_tier.get(tier, 0)
        if tokens:
            rate, tier_latency = book.rates[tier]
            load_s += tokens / load_tokens_per_s(rate, bytes_per_token)
            latency = max(latency, tier_latency)
    load_all_s = latency + load_s
    moving = hit.tokens - device_tokens
    effective = moving / load_s if load_s > 0 else float("inf")
    split = split_hit(hit.tokens, effective, prefill, page, latency)
    if split.recompute_tokens <= device_tokens or split.time_s >= load_all_s:
        return 0
    return split.recompute_tokens
