"""A step that is one fresh hit's suffix alone runs through the captured suffix forwards.

Owns ``SuffixStep``. On an otherwise idle engine, the step after a cache hit is a few new
tokens over a long past: on CUDA the captured graphs of ``kvtier.engine.graphs.SuffixGraphs``
run it with a fraction of the eager forward's launch cost (the TTFT of a short hit). So when a
step has exactly one row, that row finishes its prompt, its past is whole pages of its table
and its new tokens fit a bucket, the hit's pages are adopted by a model cache (gathered layer
by layer, each after its own copy when a host load is in flight), the graphs run, and the new
tokens' KV is written back into the row's pages, where the batched steps that follow read it.
Anything else (or a refusal, counted by ``SuffixGraphs``) takes the batched forward. Engine
thread only.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier.engine import kv_pages
from kvtier.engine.attention import MAX_QUERY_TOKENS


class SuffixStep:
    """Runs a lone fresh-hit step through ``graphs``; see the module docstring."""

    def __init__(self, lm: Any, graphs: Any) -> None:
        self.lm, self.graphs = lm, graphs
        self.served = 0

    def eligible(self, row: Any, prompt_tokens: int, fresh: bool, page_size: int) -> bool:
        return (fresh and row.start > 0 and row.start % page_size == 0
                and row.end == prompt_tokens and 1 <= len(row.tokens) <= MAX_QUERY_TOKENS)

    @torch.inference_mode()
    def run(self, row: Any, pool: torch.Tensor) -> torch.Tensor | None:
        """``[1, vocab]`` logits of the row's last token, its KV written into its pages; None
        where the graphs refuse (nothing written)."""
        page_size = pool.shape[3]
        cache = self.lm.new_cache()
        kv_pages.append_pages(cache, pool, list(row.pages[:row.start // page_size]),
                              len(row.tokens), row.ticket)
        if not self.graphs.accepts(cache, len(row.tokens)):
            return None
        logits = self.graphs.forward(list(row.tokens), cache)
        if logits is None:
            return None
        write_span(cache, pool, row.pages, row.start, row.end)
        self.served += 1
        return logits.unsqueeze(0)


def write_span(cache: Any, pool: torch.Tensor, pages: Any, start: int, end: int) -> None:
    """Copy the cache's tokens ``[start, end)`` into their slots of ``pages`` (any alignment)."""
    page_size, heads, dim = pool.shape[3], pool.shape[4], pool.shape[5]
    table = torch.as_tensor(list(pages), dtype=torch.long)
    slots = (table[:, None] * page_size + torch.arange(page_size)).reshape(-1)[start:end]
    slots = slots.to(pool.device)
    for layer in range(pool.shape[0]):
        for part, tensor in enumerate(kv_pages.cache_layer_kv(cache, layer)):
            flat = pool[layer, part].view(-1, heads, dim)
            flat.index_copy_(0, slots, tensor[0, :, start:end].transpose(0, 1).to(flat.dtype))
