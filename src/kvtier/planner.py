"""Sizing planner and load-vs-recompute cost model: pure functions, no torch, any thread.

Owns two things the rest of kvtier asks before it allocates or loads:

- **Sizing** (``plan``): from a KV layout, the host budgets and the stores' rates, how many host
  pool pages, read-ring slots (one per page a prefetch read has in flight, taken before the read
  is issued) and staging write slots (drain rate x write residency x burst margin for each store
  that write-through feeds, the larger one, rounded up), and whether the pinned bytes fit the
  budget. When write-through produces faster than a store drains (``sustainable``) no staging size
  is correct: the plan refuses and says backpressure is needed.
- **Cost model** (``load_tokens_per_s``, ``split_hit``): loading a tier moves
  ``bandwidth / bytes_per_token`` tokens per second; the model prefills ``P`` tokens per second.
  A hit is split so that recomputing its head and loading its tail finish together.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.config import KvtierConfig
from kvtier.layout import KVLayout
from kvtier.memory.admission import staging_capacity_pages

# ---- cost model ------------------------------------------------------------------------------


def load_tokens_per_s(read_bytes_per_s: float, bytes_per_token: int) -> float:
    """Tokens of KV per second a tier delivers at ``read_bytes_per_s``."""
    if bytes_per_token < 1:
        raise ValueError(f"bytes_per_token must be >= 1, got {bytes_per_token}")
    return max(read_bytes_per_s, 0.0) / bytes_per_token


@dataclass(frozen=True)
class HitSplit:
    """How to serve ``hit_tokens`` cached tokens: recompute the first ``recompute_tokens``
    while the remaining ``load_tokens`` load from the tier; times in seconds."""

    hit_tokens: int
    recompute_tokens: int
    load_tokens: int
    time_s: float
    recompute_all_s: float
    load_all_s: float

    @property
    def loading_pays(self) -> bool:
        """Whether loading any of the hit beats recomputing all of it."""
        return self.load_tokens > 0 and self.time_s < self.recompute_all_s

    @property
    def speedup(self) -> float:
        """Recompute-everything time over the split's time (1.0 = no gain)."""
        return self.recompute_all_s / self.time_s if self.time_s > 0 else 1.0


PrefillTime = Callable[[int], float]


def _split_time(recompute: int, hit: int, load_rate: float, prefill_time: PrefillTime,
                latency_s: float, recompute_fixed_s: float = 0.0) -> float:
    loaded = hit - recompute
    if loaded == 0:
        return prefill_time(recompute)  # the whole hit runs in the prompt's one forward
    t_recompute = 0.0 if recompute == 0 else recompute_fixed_s + prefill_time(recompute)
    t_load = math.inf if load_rate <= 0 else latency_s + loaded / load_rate
    return max(t_recompute, t_load)


def _crossing(hit: int, page_size: int, load_rate: float, prefill_time: PrefillTime,
              latency_s: float, recompute_fixed_s: float) -> int:
    """The last page boundary where recomputing the head is still quicker than loading the
    tail (recompute time grows with the head, load time shrinks: a bisection)."""
    lo, hi = 0, hit // page_size
    while lo < hi:
        mid = (lo + hi + 1) // 2
        head = mid * page_size
        if recompute_fixed_s + prefill_time(head) <= latency_s + (hit - head) / load_rate:
            lo = mid
        else:
            hi = mid - 1
    return lo * page_size


def split_hit(hit_tokens: int, load_rate: float, prefill_rate: float, page_size: int = 1,
              latency_s: float = 0.0, recompute_fixed_s: float = 0.0,
              prefill_time: PrefillTime | None = None) -> HitSplit:
    """Split a hit of ``hit_tokens`` (a multiple of ``page_size``) between recompute and load.

    ``load_rate`` is the tier's tokens per second (``load_tokens_per_s``), ``prefill_rate`` the
    model's prefill tokens per second, ``latency_s`` the tier's fixed cost per load (first byte
    and per-request overhead), ``recompute_fixed_s`` the fixed cost of running the head as a
    forward of its own. Recomputing ``r`` head tokens takes ``fixed + r / P``; loading the tail
    takes ``latency + (hit - r) / L``; they finish together at
    ``r = P (hit + L (latency - fixed)) / (L + P)``, rounded to whichever neighbouring page
    boundary is faster. Loading nothing (the hit runs in the prompt's own forward: ``hit / P``)
    or everything are candidates too; ties favour loading.

    ``prefill_time`` (seconds to prefill the first ``n`` tokens of a prompt), when given,
    replaces ``n / prefill_rate``: attention makes prefill superlinear in the prompt length, so
    recomputing the head of a long hit costs less than its share of the whole. The split is then
    found by bisection.
    """
    if hit_tokens < 0 or page_size < 1:
        raise ValueError(f"hit of {hit_tokens} tokens with pages of {page_size}")
    if prefill_rate <= 0:
        raise ValueError(f"prefill rate must be > 0 tokens/s, got {prefill_rate}")
    hit = hit_tokens - hit_tokens % page_size
    timed = prefill_time or (lambda n: n / prefill_rate)
    if load_rate <= 0:
        lower = hit
    elif prefill_time is not None:
        lower = _crossing(hit, page_size, load_rate, timed, latency_s, recompute_fixed_s)
    else:
        ideal = prefill_rate * (hit + load_rate * (latency_s - recompute_fixed_s)) \
            / (load_rate + prefill_rate)
        lower = max(0, min(hit, int(ideal // page_size) * page_size))
    upper = min(hit, lower + page_size)

    def cost(r: int) -> float:
        return _split_time(r, hit, load_rate, timed, latency_s, recompute_fixed_s)

    best = min((0, lower, upper, hit), key=lambda r: (cost(r), r))
    return HitSplit(
        hit_tokens=hit, recompute_tokens=best, load_tokens=hit - best, time_s=cost(best),
        recompute_all_s=timed(hit), load_all_s=cost(0),
    )


# ---- sizing ----------------------------------------------------------------------------------


def sustainable(produce_rate: float, drain_rate: float) -> bool:
    """Whether a store draining at ``drain_rate`` keeps up with write-through producing at
    ``produce_rate`` (same units). If not, no staging size is correct: backpressure is."""
    if produce_rate < 0 or drain_rate < 0:
        raise ValueError(f"rates must be >= 0, got {produce_rate} and {drain_rate}")
    return produce_rate <= drain_rate


def staging_slots_for(drain_pages_per_s: float, write_residency_s: float,
                      burst_margin: float) -> int:
    """Staging pages one store needs: pages in flight (drain x residency) times the burst
    margin, rounded up."""
    if drain_pages_per_s < 0 or write_residency_s < 0 or burst_margin < 1:
        raise ValueError("need drain >= 0, residency >= 0 and burst margin >= 1")
    return math.ceil(round(drain_pages_per_s * write_residency_s * burst_margin, 9))


def read_ring_slots_for(io_workers: int, pages_per_read: int) -> int:
    """Read-ring slots: every IO worker takes its landing slots before it issues a read."""
    if io_workers < 1 or pages_per_read < 1:
        raise ValueError("need io_workers >= 1 and pages_per_read >= 1")
    return io_workers * pages_per_read


@dataclass(frozen=True)
class StoreRates:
    """One store tier's measured or given rates (bytes per second, seconds)."""

    name: str
    read_bytes_per_s: float = 0.0
    write_bytes_per_s: float = 0.0
    latency_s: float = 0.0
    write_through: bool = True
    write_residency_s: float = 0.0

    def residency_s(self, page_bytes: int, writes_in_flight: int) -> float:
        """How long a staged page waits for its store acknowledgement: the given residency,
        else the latency plus its share of the bandwidth with ``writes_in_flight`` pages
        being written at once."""
        if self.write_residency_s > 0:
            return self.write_residency_s
        if self.write_bytes_per_s <= 0:
            return math.inf
        return self.latency_s + writes_in_flight * page_bytes / self.write_bytes_per_s


@dataclass(frozen=True)
class PlanInputs:
    """Everything ``plan`` reads; rates of 0 mean unknown."""

    layout: KVLayout
    host_pool_bytes: int
    pinned_budget_bytes: int
    prefetch_share: float = 0.5
    io_workers: int = 4
    pages_per_read: int = 1
    read_ring_slots: int = 0
    burst_margin: float = 2.0
    host_read_bytes_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    produce_tokens_per_s: float = 0.0
    stores: tuple[StoreRates, ...] = ()


def inputs_from_config(config: KvtierConfig, layout: KVLayout, **overrides: Any) -> PlanInputs:
    """``PlanInputs`` from the config's host and controller sections; ``overrides`` (rates,
    stores, margins) replace any field."""
    fields = {"layout": layout, "host_pool_bytes": config.host.pool_bytes,
              "pinned_budget_bytes": config.host.pinned_budget_bytes,
              "prefetch_share": config.host.prefetch_share,
              "io_workers": config.controller.io_workers,
              "read_ring_slots": config.host.read_ring_slots}
    return PlanInputs(**{**fields, **overrides})


@dataclass
class Plan:
    """The planner's answer; ``to_dict()`` is what ``kvtier plan --json`` prints."""

    host_pages: int
    host_pool_bytes: int
    page_bytes: int
    bytes_per_token: int
    prefetch_landing_pages: int
    staging_capacity_pages: int
    read_ring_slots: int
    read_ring_bytes: int
    staging_write_slots: int | None
    staging_fits: bool | None
    pinned_bytes: int
    pinned_budget_bytes: int
    fits_budget: bool
    sustainable: bool | None
    produce_bytes_per_s: float
    consumers: list[dict[str, Any]] = field(default_factory=list)
    tiers: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _consumer(store: StoreRates, inputs: PlanInputs, produce_bps: float) -> dict[str, Any]:
    page_bytes = inputs.layout.page_bytes
    drain_pages = store.write_bytes_per_s / page_bytes
    ok = sustainable(produce_bps, store.write_bytes_per_s) if produce_bps > 0 else None
    residency = store.residency_s(page_bytes, inputs.io_workers)
    slots = (staging_slots_for(drain_pages, residency, inputs.burst_margin)
             if drain_pages > 0 else None)
    return {"name": store.name, "write_bytes_per_s": store.write_bytes_per_s,
            "drain_pages_per_s": drain_pages, "write_residency_s": residency,
            "staging_slots": slots, "sustainable": ok}


def _tier_cost(name: str, read_bps: float, latency_s: float, inputs: PlanInputs,
               reference_hit: int) -> dict[str, Any]:
    lay = inputs.layout
    rate = load_tokens_per_s(read_bps, lay.bytes_per_token)
    row: dict[str, Any] = {"name": name, "read_bytes_per_s": read_bps, "latency_s": latency_s,
                           "load_tokens_per_s": rate}
    if inputs.prefill_tokens_per_s > 0:
        split = split_hit(reference_hit, rate, inputs.prefill_tokens_per_s, lay.page_size,
                          latency_s)
        row.update({"load_over_prefill": rate / inputs.prefill_tokens_per_s,
                    "reference_hit_tokens": split.hit_tokens,
                    "recompute_share": split.recompute_tokens / max(split.hit_tokens, 1),
                    "split_time_s": split.time_s, "recompute_all_s": split.recompute_all_s,
                    "speedup": split.speedup, "loading_pays": split.loading_pays})
    return row


def plan(inputs: PlanInputs, reference_hit_tokens: int = 16384) -> Plan:
    """Size the host tier for ``inputs``; see the module docstring."""
    lay = inputs.layout
    page_bytes = lay.page_bytes
    host_pages = inputs.host_pool_bytes // page_bytes
    staging_cap = staging_capacity_pages(host_pages, inputs.prefetch_share)
    ring_slots = inputs.read_ring_slots or read_ring_slots_for(inputs.io_workers,
                                                               inputs.pages_per_read)
    ring_bytes = ring_slots * _aligned(page_bytes)
    pinned = host_pages * page_bytes + ring_bytes
    produce_bps = inputs.produce_tokens_per_s * lay.bytes_per_token
    writers = [s for s in inputs.stores if s.write_through]
    consumers = [_consumer(s, inputs, produce_bps) for s in writers]
    verdicts = [c["sustainable"] for c in consumers]
    is_sustainable = None if not verdicts or None in verdicts else all(verdicts)
    sized = [c["staging_slots"] for c in consumers if c["staging_slots"] is not None]
    staging = max(sized) if sized and is_sustainable is not False else None
    tiers = [_tier_cost("host", inputs.host_read_bytes_per_s, 0.0, inputs, reference_hit_tokens)]
    tiers += [_tier_cost(s.name, s.read_bytes_per_s, s.latency_s, inputs, reference_hit_tokens)
              for s in inputs.stores]
    result = Plan(
        host_pages=host_pages, host_pool_bytes=host_pages * page_bytes, page_bytes=page_bytes,
        bytes_per_token=lay.bytes_per_token, prefetch_landing_pages=host_pages - staging_cap,
        staging_capacity_pages=staging_cap, read_ring_slots=ring_slots,
        read_ring_bytes=ring_bytes, staging_write_slots=staging,
        staging_fits=None if staging is None else staging <= staging_cap,
        pinned_bytes=pinned, pinned_budget_bytes=inputs.pinned_budget_bytes,
        fits_budget=pinned <= inputs.pinned_budget_bytes, sustainable=is_sustainable,
        produce_bytes_per_s=produce_bps, consumers=consumers, tiers=tiers)
    result.problems = _problems(result, inputs)
    return result


def _aligned(nbytes: int, align: int = 4096) -> int:
    return -(-nbytes // align) * align


def _problems(p: Plan, inputs: PlanInputs) -> list[str]:
    out: list[str] = []
    if p.host_pages == 0 and inputs.host_pool_bytes > 0:
        out.append(f"host pool of {inputs.host_pool_bytes} bytes holds no {p.page_bytes}-byte page")
    if not p.fits_budget:
        room = max(inputs.pinned_budget_bytes - p.read_ring_bytes, 0) // p.page_bytes
        out.append(f"pinned bytes {p.pinned_bytes} exceed the budget {p.pinned_budget_bytes}: "
                   f"at most {room} host pages fit beside the read ring")
    for c in p.consumers:
        if c["sustainable"] is False:
            out.append(f"write-through produces {p.produce_bytes_per_s:.3g} B/s but {c['name']} "
                       f"drains {c['write_bytes_per_s']:.3g} B/s: no staging size keeps up; "
                       "backpressure is needed (throttle commits, write_through_selective, or "
                       "write_back)")
    if p.staging_fits is False:
        out.append(f"staging needs {p.staging_write_slots} pages but only "
                   f"{p.staging_capacity_pages} are outside the prefetch share")
    return out
