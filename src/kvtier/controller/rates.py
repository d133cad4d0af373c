"""What each tier delivers and how fast the model prefills, learnt from what the cache observes.

Owns ``RateBook`` (per tier: read bytes/s and the fixed cost of a load before its first byte;
the model's prefill rate and the fixed cost of a forward; how late past splits ran) and the fits
it learns with (``LineFit``, ``QuadraticFit``). ``split.plan_split`` prices a hit with it; the
shared state (``context.CacheContext.rates``) holds it.

Rates start from the figures measured on our machines (``docs/architecture.md``) and follow
what this cache observes. Finished prefetch and load-back jobs update a tier's bandwidth (an
exponential average). Whole loads, timed by the engine from ``load`` to KV on the device
(``observe_load``), teach the tier's fixed cost per load (first-byte latency plus per-request
overhead: queueing, the host -> device copy, bookkeeping) and its effective bandwidth: a
weighted line fit of seconds against bytes (``LineFit``) once loads of different sizes were
seen, else the time a load took beyond what the bandwidth explains. Prefills (``observe_prefill``)
are fitted the same way: their slope is the prefill rate, their intercept the fixed cost of a
forward of its own (what a split's separate head forward adds). Attention makes long prefills
superlinear, so once prefills of three clearly different lengths were seen a quadratic
(``QuadraticFit``: fixed + per token + per token pair) prices the head instead: recomputing the
first 24k tokens of a 32k hit costs far less than three quarters of the whole. Every split the
engine runs is timed to its first token (``observe_split``): how late it was, per hit size
within a factor of two, is added to later predictions. Engine thread only; numpy, no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

#: Starting read rates (bytes/s) and fixed costs per load (s), before measurements.
DEFAULT_RATES: dict[str, tuple[float, float]] = {
    "host": (50e9, 0.0),        # pinned host -> device through UVA kernels (H200 machine)
    "disk": (1.5e9, 200e-6),    # cold local NVMe, 1-32 threads
    "remote": (1.0e9, 500e-6),  # Redis on loopback, pipelined
}
CPU_HOST_RATE = 5e9            # host -> "device" copies when the device is the CPU
SMOOTHING = 0.2
#: A fit's x values must spread by this share of their mean before its slope is trusted.
MIN_RELATIVE_SPREAD = 0.25


@dataclass
class LineFit:
    """Exponentially weighted least squares of ``y = intercept + slope * x``."""

    weight: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    count: int = 0

    def add(self, x: float, y: float, smoothing: float = SMOOTHING) -> None:
        keep = 1.0 - smoothing if self.count else 0.0
        self.weight = self.weight * keep + 1.0
        self.sx = self.sx * keep + x
        self.sy = self.sy * keep + y
        self.sxx = self.sxx * keep + x * x
        self.sxy = self.sxy * keep + x * y
        self.count += 1

    def solve(self) -> tuple[float, float] | None:
        """``(intercept, slope)`` with both >= 0, or None while the x values barely differ."""
        if self.count < 2:
            return None
        mean_x, mean_y = self.sx / self.weight, self.sy / self.weight
        var_x = self.sxx / self.weight - mean_x * mean_x
        if var_x <= 0 or var_x ** 0.5 < MIN_RELATIVE_SPREAD * abs(mean_x):
            return None
        slope = (self.sxy / self.weight - mean_x * mean_y) / var_x
        if slope <= 0:
            return None
        return max(0.0, mean_y - slope * mean_x), slope


@dataclass
class QuadraticFit:
    """Exponentially weighted least squares of ``y = a + b * x + c * x**2`` (x in thousands,
    to keep the normal equations well conditioned)."""

    sums: list[float] = field(default_factory=lambda: [0.0] * 8)   # w, x..x^4, y, xy, xxy
    lengths: list[float] = field(default_factory=list)              # recent x, for the spread

    def add(self, x: float, y: float, smoothing: float = SMOOTHING) -> None:
        keep = 1.0 - smoothing if self.lengths else 0.0
        k = x / 1000.0
        terms = (1.0, k, k * k, k ** 3, k ** 4, y, k * y, k * k * y)
        self.sums = [s * keep + t for s, t in zip(self.sums, terms, strict=True)]
        self.lengths = (self.lengths + [k])[-16:]

    def solve(self) -> tuple[float, float, float] | None:
        """``(a, b, c)`` per token (not per thousand), or None until three clearly different
        lengths were seen or when the fit is not increasing and convex."""
        distinct = sorted(set(round(k, 3) for k in self.lengths))
        if len(distinct) < 3 or distinct[-1] < 2 * distinct[0]:
            return None
        w, x1, x2, x3, x4, y, xy, xxy = self.sums
        try:
            a, b, c = np.linalg.solve([[w, x1, x2], [x1, x2, x3], [x2, x3, x4]],
                                      [y, xy, xxy]).tolist()
        except np.linalg.LinAlgError:
            return None
        if c < 0 or b < 0:
            return None
        return max(0.0, a), b / 1000.0, c / 1e6


@dataclass
class RateBook:
    """Per-tier ``(read bytes/s, fixed seconds per load)``, and the model's prefill rate
    (tokens/s) and fixed cost per forward (s)."""

    rates: dict[str, tuple[float, float]] = field(default_factory=lambda: dict(DEFAULT_RATES))
    prefill_tokens_per_s: float | None = None
    prefill_fixed_s: float = 0.0
    load_fits: dict[str, LineFit] = field(default_factory=dict)
    prefill_fit: LineFit = field(default_factory=LineFit)
    prefill_curve: QuadraticFit = field(default_factory=QuadraticFit)
    split_errors: dict[int, float] = field(default_factory=dict)   # size bucket -> seconds late
    #: Per tier, how many reads were observed (0: its rate is still the starting figure).
    observed: dict[str, int] = field(default_factory=dict)
    pending_split: tuple[int, float] | None = None   # (hit tokens, predicted s) of the last split

    @classmethod
    def for_device(cls, device: str) -> RateBook:
        book = cls()
        if not str(device).startswith("cuda"):
            book.rates["host"] = (CPU_HOST_RATE, 0.0)
        return book

    def observe(self, tier: str, nbytes: int, seconds: float) -> None:
        """A finished IO job or copy: ``nbytes`` read in ``seconds`` (bandwidth only)."""
        if nbytes <= 0 or seconds <= 0:
            return
        self.observed[tier] = self.observed.get(tier, 0) + 1
        rate, fixed = self.rates[tier]
        self.rates[tier] = (rate + SMOOTHING * (nbytes / seconds - rate), fixed)

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        """A whole load from ``tier``: ``nbytes`` on the device ``seconds`` after it began.
        Learns the tier's fixed cost per load (and its bandwidth, once sizes differ)."""
        if nbytes <= 0 or seconds <= 0:
            return
        self.observed[tier] = self.observed.get(tier, 0) + 1
        fit = self.load_fits.setdefault(tier, LineFit())
        fit.add(float(nbytes), seconds)
        rate, fixed = self.rates[tier]
        solved = fit.solve()
        if solved is not None:
            self.rates[tier] = (1.0 / solved[1], solved[0])
            return
        beyond = max(0.0, seconds - nbytes / rate)  # what the bandwidth does not explain
        self.rates[tier] = (rate, beyond if fit.count == 1 else fixed + SMOOTHING * (beyond - fixed))

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        self.prefill_fit.add(float(tokens), seconds)
        self.prefill_curve.add(float(tokens), seconds)
        solved = self.prefill_fit.solve()
        if solved is not None:
            self.prefill_fixed_s, per_token = solved
            self.prefill_tokens_per_s = 1.0 / per_token
            return
        seen = tokens / seconds
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = seen if old is None else old + SMOOTHING * (seen - old)


    def split_error(self, hit_tokens: int) -> float:
        """Seconds by which splits of hits about this size ran past their prediction."""
        return self.split_errors.get(split_bucket(hit_tokens), 0.0)

    def observe_split(self, hit_tokens: int, predicted_s: float, seconds: float) -> None:
        """A split prefill that was predicted to take ``predicted_s`` took ``seconds`` (first
        token out). What the model missed (separate forwards' launch costs, a cold first read)
        is added to later predictions for hits of about this size: a split that cannot beat
        recomputing is not taken again."""
        if seconds <= 0 or predicted_s <= 0:
            return
        bucket = split_bucket(hit_tokens)
        miss = seconds - predicted_s
        old = self.split_errors.get(bucket)
        self.split_errors[bucket] = miss if old is None else old + 2 * SMOOTHING * (miss - old)

    def prefill_time(self) -> Callable[[int], float] | None:
        """Seconds to prefill ``n`` tokens from the quadratic fit, or None until it holds."""
        solved = self.prefill_curve.solve()
        if solved is None:
            return None
        a, b, c = solved
        return lambda n: a + b * n + c * n * n


def split_bucket(hit_tokens: int) -> int:
    """Hits within a factor of two share what their splits taught (log2 of the size)."""
    return max(int(hit_tokens), 1).bit_length()
