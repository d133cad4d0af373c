"""Next-token choice: greedy, or temperature + nucleus (top-p) sampling with a per-request seed.

Owns ``SamplingParams`` and ``Sampler``. Greedy (temperature 0) is exact argmax, so cached and
uncached runs produce the same tokens. A seeded sampler draws from its own ``torch.Generator``,
so a request's output does not depend on what else the engine runs. Engine thread only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens: ``temperature`` 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """Picks the next token from one position's logits."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._generator: torch.Generator | None = None
        if not params.greedy:
            self._generator = torch.Generator(device="cpu")
            if params.seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        if self.params.greedy:
            return int(torch.argmax(logits).item())
        # shift so the best logit is 0: a temperature near 0 then tends to greedy, never to nan
        shifted = logits.double().cpu() - logits.max().item()
        probs = torch.softmax(shifted / self.params.temperature, dim=-1)
        if self.params.top_p < 1.0:
            probs = _nucleus(probs, self.params.top_p)
        return int(torch.multinomial(probs, 1, generator=self._generator).item())


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``."""
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop = mass_before >= top_p
    drop[0] = False  # the most likely token always stays, however small top_p is
    sorted_probs[drop] = 0.0
    kept = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return kept / kept.sum()
