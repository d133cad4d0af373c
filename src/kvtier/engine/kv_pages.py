"""KV <-> pages: move attention KV between a transformers ``DynamicCache`` and device pool pages.

Owns the two conversions the engine needs around the device pool tensor ``kv`` of shape
``[num_layers, parts, num_pages, page_size, kv_heads, head_dim]`` (docs/architecture.md, "Device
pool"): ``append_pages`` (pages in prefix order -> the end of a cache, so the model sees them as
past tokens) and ``write_pages`` (a token span of a cache -> pages). A cache layer holds
``[1, kv_heads, tokens, head_dim]``; page ``d`` of layer ``l`` holds ``kv[l, part, d]`` as
``[page_size, kv_heads, head_dim]``. Runs on the engine thread only.

Caches made by ``new_cache`` hold every layer in a ``RoomyLayer``: its keys and values are views
of buffers with room past their end, and ``update`` writes new tokens into that room instead of
concatenating the whole past again (transformers' ``DynamicLayer`` copies all of it on every
forward: 4 GiB per step for 32k tokens of an 8B model). ``append_pages`` gathers a prefix's pages
in one ``index_select`` straight into such a buffer, with room for the rest of the prompt.
"""

from __future__ import annotations

import functools
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


@torch.inference_mode()  # the model's forward writes into these buffers in that mode
def append_pages(cache: Any, kv: torch.Tensor, page_ids: Sequence[int],
                 reserve_tokens: int = 0, ticket: Any = None) -> int:
    """Append the KV of ``page_ids`` (prefix order) after the tokens ``cache`` holds, with room
    for ``reserve_tokens`` more; returns the tokens appended.

    Into an empty cache of ``RoomyLayer``s each layer's pages are gathered straight into its
    buffers when the forward first reaches that layer. ``ticket`` (a per-layer copy still in
    flight, ``Loaded.ticket``) makes that gather wait on the device for the layer's own copy,
    so layer ``l`` computes while later layers are still crossing the bus."""
    if not page_ids:
        return 0
    page_size = kv.shape[3]
    tokens = len(page_ids) * page_size
    if all(isinstance(layer, _roomy_class()) and layer.get_seq_length() == 0
           for layer in cache.layers[:kv.shape[0]]):
        capacity_pages = len(page_ids) + -(-max(reserve_tokens, 0) // page_size)
        index = _index(page_ids, kv.device)
        # one allocation for every layer's buffers: fewer calls before the forward can start
        buffers = kv.new_empty((kv.shape[0], kv.shape[1], capacity_pages, *kv.shape[3:]))
        for layer in range(kv.shape[0]):
            cache.layers[layer].adopt_pages(kv[layer], index, buffers[layer], ticket, layer)
        return tokens
    if ticket is not None:
        ticket.stream_wait()
    gathered = gather_pages(kv, page_ids)
    for layer in range(gathered.shape[0]):
        cache.update(gathered[layer, 0].unsqueeze(0), gathered[layer, 1].unsqueeze(0), layer)
    return tokens


#: Spare tokens a ``RoomyLayer`` keeps when it grows: at least this, or an eighth of its length.
MIN_ROOM_TOKENS = 256


def room_for(tokens: int) -> int:
    """Buffer length for ``tokens``: spare room for what comes next, a multiple of 64."""
    wanted = tokens + max(MIN_ROOM_TOKENS, tokens // 8)
    return -(-wanted // 64) * 64


@functools.cache
def _roomy_class() -> type:
    """``RoomyLayer``, built on first use (transformers is imported lazily)."""
    from transformers.cache_utils import DynamicLayer

    class RoomyLayer(DynamicLayer):
        """A ``DynamicLayer`` whose ``keys``/``values`` are views ``[..., :length, :]`` of
        buffers with room past the end; ``update`` writes into the room (growing the buffers
        by ``room_for`` when full) instead of concatenating the past with the new tokens."""

        _key_buffer: torch.Tensor | None = None
        _value_buffer: torch.Tensor | None = None
        _pending: tuple[Any, ...] | None = None
        _ready: Any = None  # a CUDA event the buffers' last copy records (``take_static``)

        @torch.inference_mode()
        def adopt_pages(self, pool_layer: torch.Tensor, index: torch.Tensor,
                        buffer: torch.Tensor, ticket: Any, layer: int) -> None:
            """Hold the pages ``index`` of ``pool_layer`` (``[parts, pages, page_size, heads,
            dim]``) as this layer's first tokens, in ``buffer`` (``[parts, capacity_pages,
            page_size, heads, dim]``, room included), filled on first use (``fill_pending``)."""
            parts, capacity_pages, page_size, heads, dim = buffer.shape
            flat = buffer.view(parts, capacity_pages * page_size, heads, dim).transpose(1, 2)
            self.adopt(flat[0].unsqueeze(0), flat[1].unsqueeze(0), index.numel() * page_size)
            self._pending = (pool_layer, index, buffer, ticket, layer)

        @torch.inference_mode()
        def fill_pending(self) -> None:
            """Gather the adopted pages into the buffers, after the layer's copy on the device
            (and make the current stream wait for a copy into them still in flight)."""
            if self._ready is not None:
                torch.cuda.current_stream(self._key_buffer.device).wait_event(self._ready)
                self._ready = None
            if self._pending is None:
                return
            buffer = self._pending[2]
            self.gather_into(buffer.view(buffer.shape[0], -1, *buffer.shape[3:]))
            self._pending = None

        @torch.inference_mode()
        def gather_into(self, static: torch.Tensor) -> None:
            """Gather the adopted pages into ``static`` (``[parts, tokens, heads, dim]``,
            token-major) after the layer's copy on the device (no host wait; CPU tickets have
            landed); they stay adopted until ``take_static`` or ``fill_pending``."""
            pool_layer, index, _, ticket, layer = self._pending
            if ticket is not None:
                ticket.stream_wait(layer=layer)
            count, page_size = index.numel(), pool_layer.shape[2]
            for part in range(pool_layer.shape[0]):
                out = static[part, :count * page_size].view(count, page_size, *static.shape[2:])
                torch.index_select(pool_layer[part], 0, index, out=out)

        @torch.inference_mode()
        def take_static(self, static: torch.Tensor, length: int) -> None:
            """Hold the first ``length`` tokens of ``static`` (as ``gather_into``) as this
            layer's KV, in place of the adopted pages (copied on the current stream; if that is
            a side stream, tell the layer with ``use_after``)."""
            buffer = self._pending[2]
            self._pending = None
            flat = buffer.view(buffer.shape[0], -1, *buffer.shape[3:])
            flat[:, :length].copy_(static[:, :length])
            if buffer.is_cuda:
                buffer.record_stream(torch.cuda.current_stream(buffer.device))
            self.keys = self._key_buffer[..., :length, :]
            self.values = self._value_buffer[..., :length, :]

        def use_after(self, event: Any) -> None:
            """Make the next use of the buffers wait on the device for ``event`` (a CUDA event
            recorded after a copy into them on a side stream)."""
            self._ready = event

        @property
        def room_tokens(self) -> int:
            """Tokens the buffers hold at most without growing."""
            return 0 if self._key_buffer is None else self._key_buffer.shape[-2]

        def adopt(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
            """Take ``keys``/``values`` ``[batch, heads, capacity, dim]`` as the buffers, of
            which the first ``length`` positions hold KV."""
            self.lazy_initialization(keys[..., :0, :], values[..., :0, :])
            self._key_buffer, self._value_buffer = keys, values
            self.keys, self.values = keys[..., :length, :], values[..., :length, :]

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if self._pending is not None or self._ready is not None:
                self.fill_pending()
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            past = self.get_seq_length()
            end = past + key_states.shape[-2]
            if not self._fits(key_states, end):
                self._grow(key_states, value_states, past, end)
            self._key_buffer[..., past:end, :].copy_(key_states)
            self._value_buffer[..., past:end, :].copy_(value_states)
            self.keys = self._key_buffer[..., :end, :]
            self.values = self._value_buffer[..., :end, :]
            return self.keys, self.values

        def _fits(self, key_states: torch.Tensor, end: int) -> bool:
            """Whether the buffers still back ``keys`` (nothing replaced them) with room."""
            buffer = self._key_buffer
            if buffer is None or end > buffer.shape[-2] or self.keys.dim() != buffer.dim():
                return False
            return (self.keys.data_ptr() == buffer.data_ptr()
                    and buffer.shape[:-2] == key_states.shape[:-2])

        def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, past: int,
                  end: int) -> None:
            capacity = room_for(end)
            lead = tuple(key_states.shape[:-2])
            keys = key_states.new_empty((*lead, capacity, key_states.shape[-1]))
            values = value_states.new_empty((*lead, capacity, value_states.shape[-1]))
            if past:
                keys[..., :past, :].copy_(self.keys)
                values[..., :past, :].copy_(self.values)
            self._key_buffer, self._value_buffer = keys, values

    return RoomyLayer


def pending_hit(layer: Any) -> Any:
    """``layer`` if it is a ``RoomyLayer`` holding adopted pages not gathered yet, else None."""
    return layer if getattr(layer, "_pending", None) is not None else None


def roomy_layers(cache: Any) -> Any:
    """Give ``cache`` (a fresh ``DynamicCache``) ``RoomyLayer``s where it has plain dynamic
    layers (full attention); returns it."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if layers:
        cache.layers = [_roomy_class()() if type(layer) is DynamicLayer else layer
                        for layer in layers]
    return cache


def cache_layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, values)`` of one cache layer, each ``[1, kv_heads, tokens, head_dim]``."""
    entry = cache.layers[layer]
    fill = getattr(entry, "fill_pending", None)
    if fill is not None:
        fill()
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
