"""KV <-> pages: move attention KV between a transformers ``DynamicCache`` and device pool pages.

Owns the two conversions the engine needs around the device pool tensor ``kv`` of shape
``[num_layers, parts, num_pages, page_size, kv_heads, head_dim]`` (docs/architecture.md, "Device
pool"): ``append_pages`` (pages in prefix order -> the end of a cache, so the model sees them as
past tokens) and ``write_pages`` (a token span of a cache -> pages). A cache layer holds
``[1, kv_heads, tokens, head_dim]``; page ``d`` of layer ``l`` holds ``kv[l, part, d]`` as
``[page_size, kv_heads, head_dim]``. Runs on the engine thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvtier.errors import LayoutMismatch


def _index(page_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(list(page_ids), dtype=torch.long, device=device)


def check_pool(kv: torch.Tensor, num_layers: int, kv_heads: int, head_dim: int,
               dtype: torch.dtype) -> None:
    """Raise ``LayoutMismatch`` unless the pool tensor fits the model."""
    if kv.dim() != 6 or kv.shape[0] != num_layers or kv.shape[1] != 2 \
            or tuple(kv.shape[4:]) != (kv_heads, head_dim) or kv.dtype != dtype:
        raise LayoutMismatch(
            f"device pool {tuple(kv.shape)} {kv.dtype} does not fit a model with {num_layers} "
            f"layers, {kv_heads} KV heads of {head_dim} ({dtype})")


def gather_pages(kv: torch.Tensor, page_ids: Sequence[int]) -> torch.Tensor:
    """Pages in prefix order as one tensor ``[layers, parts, kv_heads, tokens, head_dim]``."""
    chosen = kv.index_select(2, _index(page_ids, kv.device))
    layers, parts, pages, page_size, heads, dim = chosen.shape
    return chosen.reshape(layers, parts, pages * page_size, heads, dim).transpose(2, 3)


def append_pages(cache: Any, kv: torch.Tensor, page_ids: Sequence[int]) -> int:
    """Append the KV of ``page_ids`` (prefix order) after the tokens ``cache`` holds; returns
    the tokens appended."""
    if not page_ids:
        return 0
    gathered = gather_pages(kv, page_ids)
    for layer in range(gathered.shape[0]):
        cache.update(gathered[layer, 0].unsqueeze(0), gathered[layer, 1].unsqueeze(0), layer)
    return int(gathered.shape[3])


def cache_layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, values)`` of one cache layer, each ``[1, kv_heads, tokens, head_dim]``."""
    entry = cache.layers[layer]
    return entry.keys, entry.values


def write_pages(cache: Any, kv: torch.Tensor, first_token: int, page_ids: Sequence[int]) -> None:
    """Copy the cache's tokens ``[first_token, first_token + len(page_ids) * page_size)`` into
    device pages ``page_ids`` (in order), for every layer."""
    if not page_ids:
        return
    page_size, heads, dim = kv.shape[3], kv.shape[4], kv.shape[5]
    count = len(page_ids)
    index = _index(page_ids, kv.device)
    end = first_token + count * page_size
    for layer in range(kv.shape[0]):
        for part, tensor in enumerate(cache_layer_kv(cache, layer)):
            if tensor.shape[2] < end:
                raise ValueError(f"cache holds {tensor.shape[2]} tokens, pages need {end}")
            span = tensor[0, :, first_token:end]  # [heads, tokens, dim]
            pages = span.reshape(heads, count, page_size, dim).permute(1, 2, 0, 3)
            kv[layer, part].index_copy_(0, index, pages.to(kv.dtype))
