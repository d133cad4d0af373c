"""Load or recompute: how many of a hit's tokens the engine should recompute (``plan_split``).

Owns ``plan_split``, priced with a ``rates.RateBook``. The cost model is the planner's
(``kvtier.planner.split_hit``): recompute the head of the hit while its tail loads, so both
finish together; loading everything and recomputing everything are candidates too, so a tier
whose loads cannot win is not loaded at all. The device part of a hit costs nothing to use, so
the split is taken only if recomputing reaches past it. What splits of hits about this size
have run past their prediction (``RateBook.split_error``) is added to a split's price, so a
split that loses to recomputing (fixed costs the model misses: a second forward's launches, a
cold first read) is not taken again and the hit is recomputed instead. Until a prefill rate is
known the split is 0 (load everything: from RAM loading wins outright). Engine thread only; no
torch.
"""

from __future__ import annotations

from kvtier.controller.handles import Hit
from kvtier.controller.rates import RateBook
from kvtier.planner import load_tokens_per_s, split_hit


def plan_split(hit: Hit, book: RateBook, bytes_per_token: int) -> int:
    """Tokens at the head of ``hit`` to recompute rather than load (a page multiple): 0 (load
    everything), ``hit.tokens`` (recompute everything: loading cannot win), or a split."""
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
    moving = hit.tokens - device_tokens
    effective = moving / load_s if load_s > 0 else float("inf")
    split = split_hit(hit.tokens, effective, prefill, page, latency, book.prefill_fixed_s,
                      prefill_time=book.prefill_time())
    book.pending_split = None
    if split.recompute_tokens >= split.hit_tokens and device_tokens == 0:
        return split.hit_tokens
    if split.recompute_tokens <= device_tokens or split.time_s >= split.load_all_s:
        return 0
    expected = split.time_s + book.split_error(hit.tokens)
    if expected >= split.recompute_all_s and device_tokens == 0:
        return split.hit_tokens  # splits of this size have run late: recomputing is safer
    book.pending_split = (hit.tokens, split.time_s)
    return split.recompute_tokens
