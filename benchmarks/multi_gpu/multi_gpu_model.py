"""A random-weight decoder whose KV heads are split across tensor-parallel ranks.

Owns ``ModelShape`` and ``HeadParallelModel``: every rank builds the same weights from a seed;
a rank computes Q, K, V and attention for its KV heads only (each head by its own matmuls, so a
head's KV is bit for bit the same whatever world computed it), the ranks all-gather their heads'
attention outputs, and the output projection, MLP and logits run replicated on every rank. A TP=1
run is the same code over all heads with no gather. KV per layer is ``(k, v)``, each
``[heads, tokens, head_dim]``. RoPE is applied to K before it is cached. Rank's main thread.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

Gather = Callable[[torch.Tensor], torch.Tensor]  # [tokens, local features] -> all ranks' features
KV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class ModelShape:
    layers: int = 4
    hidden: int = 256
    kv_heads: int = 8
    q_per_kv: int = 2
    head_dim: int = 32
    mlp: int = 512
    vocab: int = 512


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _rope(x: torch.Tensor, start: int) -> torch.Tensor:
    tokens, dim = x.shape
    half = dim // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, device=x.device, dtype=torch.float32) / half))
    angles = torch.arange(start, start + tokens, device=x.device, dtype=torch.float32)[:, None] * freqs
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    a, b = x[:, :half], x[:, half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class HeadParallelModel:
    """See the module docstring. ``forward`` runs KV heads ``heads`` locally."""

    def __init__(self, shape: ModelShape, seed: int, device: str | torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        self.shape = shape
        gen = torch.Generator().manual_seed(seed)
        s = shape

        def weight(*dims: int) -> torch.Tensor:
            w = torch.randn(*dims, generator=gen) / math.sqrt(dims[-2])
            return w.to(device=device, dtype=dtype)

        q_heads = s.kv_heads * s.q_per_kv
        self.embed = torch.randn(s.vocab, s.hidden, generator=gen).to(device=device, dtype=dtype)
        self.layers = [{"q": weight(q_heads, s.hidden, s.head_dim),
                        "k": weight(s.kv_heads, s.hidden, s.head_dim),
                        "v": weight(s.kv_heads, s.hidden, s.head_dim),
                        "o": weight(q_heads * s.head_dim, s.hidden),
                        "up": weight(s.hidden, s.mlp), "gate": weight(s.hidden, s.mlp),
                        "down": weight(s.mlp, s.hidden)} for _ in range(s.layers)]
        self.lm_head = weight(s.hidden, s.vocab)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, past: KV | None, heads: tuple[int, int],
                gather: Gather | None = None) -> tuple[torch.Tensor, KV]:
        """Logits of the last token and the KV (past + new) of heads ``[h0, h1)``."""
        start = past[0][0].shape[1] if past else 0
        x = self.embed[tokens]
        out_kv: KV = []
        for i, w in enumerate(self.layers):
            h = _rms(x)
            past_kv = past[i] if past else None
            attn, kv = self._attention(h, w, heads, start, past_kv)
            out_kv.append(kv)
            x = x + (gather(attn) if gather else attn) @ w["o"]
            h = _rms(x)
            x = x + (torch.nn.functional.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"]
        return _rms(x[-1]) @ self.lm_head, out_kv

    def _attention(self, h: torch.Tensor, w: dict[str, torch.Tensor], heads: tuple[int, int],
                   start: int, past: tuple[torch.Tensor, torch.Tensor] | None
                   ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        tokens, d = h.shape[0], self.shape.head_dim
        ks, vs, outs = [], [], []
        mask = torch.ones(tokens, start + tokens, dtype=torch.bool, device=h.device).tril(start)
        for j, head in enumerate(range(*heads)):
            k = _rope(h @ w["k"][head], start)
            v = h @ w["v"][head]
            if past is not None:
                k, v = torch.cat([past[0][j], k]), torch.cat([past[1][j], v])
            ks.append(k)
            vs.append(v)
            for q_head in range(head * self.shape.q_per_kv, (head + 1) * self.shape.q_per_kv):
                q = _rope(h @ w["q"][q_head], start)
                scores = (q @ k.T / math.sqrt(d)).masked_fill(~mask, float("-inf"))
                outs.append(torch.softmax(scores, dim=-1) @ v)
        return torch.cat(outs, dim=-1), (torch.stack(ks), torch.stack(vs))

    def greedy(self, tokens: torch.Tensor, past: KV | None, steps: int) -> list[int]:
        """``steps`` greedy tokens after ``tokens`` (fed after ``past``), all heads local."""
        every = (0, self.shape.kv_heads)
        logits, kv = self.forward(tokens, past, every)
        out = [int(logits.argmax())]
        for _ in range(steps - 1):
            logits, kv = self.forward(torch.tensor([out[-1]], device=tokens.device), kv, every)
            out.append(int(logits.argmax()))
        return out
