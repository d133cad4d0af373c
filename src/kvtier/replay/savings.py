"""What a replay is worth: prefill GPU time a cache configuration saves on a trace.

Owns the prefill time model and the pricing of a replay's per-request hits with the planner's
load-vs-recompute model (``kvtier.planner.split_hit``). For a request of ``L`` input tokens whose
first ``d`` tokens are on the device, the next ``h`` on the host and the next ``k`` on the disk:

- without the cache the prefill costs ``T(L)``, with ``T(n) = a n + b n^2`` (linear work plus
  attention over the prefix) fitted to the prefill times measured on the H200 machine;
- with the cache the suffix costs ``T(L) - T(d + h + k)`` (its attention over the cached prefix
  included), device tokens cost nothing, and a host or disk part costs what ``split_hit`` says:
  recompute its head while loading its tail so both finish together, at the tier's measured read
  rate and the prefill rate of that span (its share of ``T``), loads not overlapped with the
  suffix's compute (conservative).

Times are GPU-seconds of one H200-class GPU; with tensor parallelism over ``N`` GPUs both the
compute and the buses scale by ``N``, so GPU-seconds stay the same. Pure functions, any thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtier.layout import KVLayout
from kvtier.planner import load_tokens_per_s, split_hit

#: Prefill of a Llama-3-8B-shaped model on the H200 machine (tokens, seconds), bf16, SDPA.
H200_8B_PREFILL: tuple[tuple[int, float], ...] = (
    (1024, 0.032), (4096, 0.122), (16384, 0.587), (32768, 1.40))

#: Measured read rates on the H200 machine, bytes per second: pinned host -> device, and a cold
#: local-disk read (the low end of the measured 1.1-2.0 GB/s).
H200_READ_BYTES_PER_S: dict[str, float] = {"host": 55e9, "disk": 1.1e9}


@dataclass(frozen=True)
class ModelShape:
    """The parts of a model's shape that set its KV bytes and its prefill work."""

    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int

    def layout(self, page_size: int = 1) -> KVLayout:
        return KVLayout(self.layers, self.kv_heads, self.head_dim, "bfloat16", page_size)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layout().bytes_per_token


MODEL_SHAPES: dict[str, ModelShape] = {
    "8b": ModelShape("llama3-8b", 8.03e9, 32, 8, 128, 4096),
    "70b": ModelShape("llama3-70b", 70.6e9, 80, 8, 128, 8192),
}


@dataclass(frozen=True)
class PrefillModel:
    """``T(n) = linear * n + quadratic * n^2`` seconds for a prompt of ``n`` tokens."""

    linear: float
    quadratic: float

    @classmethod
    def fit(cls, points: Sequence[tuple[int, float]]) -> PrefillModel:
        """Least-squares fit of both coefficients to measured (tokens, seconds) points."""
        s11 = sum(n * n for n, _ in points)
        s12 = sum(n ** 3 for n, _ in points)
        s22 = sum(n ** 4 for n, _ in points)
        y1 = sum(n * t for n, t in points)
        y2 = sum(n * n * t for n, t in points)
        det = s11 * s22 - s12 * s12
        if det <= 0:
            raise ValueError("need at least two distinct prompt lengths")
        return cls((y1 * s22 - y2 * s12) / det, (s11 * y2 - s12 * y1) / det)

    def time(self, tokens: float) -> float:
        return self.linear * tokens + self.quadratic * tokens * tokens

    def scaled_to(self, source: ModelShape, target: ModelShape) -> PrefillModel:
        """Another shape at the same efficiency: linear work scales with parameters, attention
        with layers x hidden size."""
        return PrefillModel(self.linear * target.params / source.params,
                            self.quadratic * (target.layers * target.hidden)
                            / (source.layers * source.hidden))


def prefill_model(shape: ModelShape) -> PrefillModel:
    """The H200 prefill model for ``shape`` (measured for 8B, scaled for other shapes)."""
    measured = PrefillModel.fit(H200_8B_PREFILL)
    return measured.scaled_to(MODEL_SHAPES["8b"], shape)


def _span_time(model: PrefillModel, start: int, tokens: int, read_bps: float,
               bytes_per_token: int) -> float:
    """Seconds to provide ``tokens`` cached tokens after ``start`` from a tier."""
    if tokens <= 0:
        return 0.0
    recompute = model.time(start + tokens) - model.time(start)
    rate = load_tokens_per_s(read_bps, bytes_per_token)
    return split_hit(tokens, rate, tokens / recompute).time_s


@dataclass(frozen=True)
class Savings:
    model: str
    prefill_s: float       # GPU-seconds of prefill without any cache
    saved_s: float         # GPU-seconds the cache saves
    saved_by_tier: dict[str, float]

    @property
    def saved_share(self) -> float:
        return self.saved_s / self.prefill_s if self.prefill_s else 0.0


def price(per_request: Iterable[tuple[int, int, int, int]], shape: ModelShape,
          read_bps: dict[str, float] | None = None) -> Savings:
    """Prefill GPU time saved by hits split per tier as (input, device, host, disk) tokens."""
    rates = H200_READ_BYTES_PER_S if read_bps is None else read_bps
    model, bpt = prefill_model(shape), shape.kv_bytes_per_token
    total = 0.0
    by_tier = {"device": 0.0, "host": 0.0, "disk": 0.0}
    for length, device, host, disk in per_request:
        total += model.time(length)
        by_tier["device"] += model.time(device)
        host_cost = _span_time(model, device, host, rates["host"], bpt)
        by_tier["host"] += model.time(device + host) - model.time(device) - host_cost
        disk_cost = _span_time(model, device + host, disk, rates["disk"], bpt)
        by_tier["disk"] += (model.time(device + host + disk) - model.time(device + host)
                            - disk_cost)
    return Savings(shape.name, total, sum(by_tier.values()), by_tier)
