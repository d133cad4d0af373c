"""How token K/V rows sit inside vLLM's per-layer paged KV tensors, and how to move them.

Owns ``BlockLayout`` and its three kinds, picked by ``block_layout()`` from the attention
backend's name and the tensor's shape:

- ``cpu``: vLLM's CPU backend, ``[num_blocks, kv_heads, block_size, 2 * head_dim]``. Inside a
  block each head holds K transposed (``[head_dim, block_size]``) and then V
  (``[block_size, head_dim]``); that is how its ``vec``/``vec16`` kernels write them.
  ``check_cpu_layout`` proves it at start with vLLM's own cache-write op, so a kernel that packs
  blocks differently (``amx`` for bf16 on AMX machines) is refused instead of read wrongly.
- ``flash``: flash-attention and the Triton backend, ``[2, num_blocks, block_size, heads, dim]``.
- ``flashinfer``: FlashInfer, ``[num_blocks, 2, block_size, heads, dim]`` (its NHD layout).

Every kind reads and writes tokens by *slot* (``block_id * block_size + offset``) as
``[tokens, kv_heads, head_dim]`` K and V tensors, which is kvtier's canonical token row (a
page is ``[layers, K|V, page_size, heads, head_dim]``), so pages are the same bytes whichever
backend wrote them. Torch only; runs on vLLM's worker thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError

KINDS = ("cpu", "flash", "flashinfer")


@dataclass(frozen=True)
class BlockLayout:
    """Geometry of one layer's paged KV tensor of one attention backend."""

    kind: str
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int

    def views(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as views indexed ``[block, offset]`` -> ``[heads, head_dim]`` rows."""
        n, b, h, d = self.num_blocks, self.block_size, self.kv_heads, self.head_dim
        if self.kind == "cpu":
            halves = kv.view(n, h, 2, b * d)
            k = halves[:, :, 0].unflatten(-1, (d, b)).permute(0, 3, 1, 2)   # [n, b, h, d]
            v = halves[:, :, 1].unflatten(-1, (b, d)).permute(0, 2, 1, 3)
            return k, v
        if self.kind == "flash":
            return kv[0], kv[1]
        return kv[:, 0], kv[:, 1]

    def read(self, kv: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows of ``slots`` as two ``[len(slots), kv_heads, head_dim]`` tensors."""
        k, v = self.views(kv)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        return k[blocks, offsets], v[blocks, offsets]

    def read_blocks(self, kv: torch.Tensor,
                    block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks as two ``[len(block_ids), block_size, kv_heads, head_dim]``
        views of one gathered copy (a block-contiguous gather, then no per-token indexing)."""
        gathered = kv.index_select(1 if self.kind == "flash" else 0, block_ids)
        n = len(block_ids)
        return BlockLayout(self.kind, n, self.block_size, self.kv_heads,
                           self.head_dim).views(gathered)

    def write(self, kv: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor) -> None:
        """Store ``[len(slots), kv_heads, head_dim]`` K and V rows at ``slots``."""
        k, v = self.views(kv)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        k[blocks, offsets] = keys.to(k.dtype)
        v[blocks, offsets] = values.to(v.dtype)


def block_layout(backend: str, kv: torch.Tensor, kv_heads: int, head_dim: int) -> BlockLayout:
    """The layout of ``kv`` (one layer's tensor) for attention backend ``backend``."""
    shape = tuple(kv.shape)
    name = backend.upper()
    if name.startswith("CPU"):
        if len(shape) == 4 and shape[1] == kv_heads and shape[3] == 2 * head_dim:
            return BlockLayout("cpu", shape[0], shape[2], kv_heads, head_dim)
    elif name.startswith("FLASHINFER"):
        if len(shape) == 5 and shape[1] == 2 and shape[3:] == (kv_heads, head_dim):
            return BlockLayout("flashinfer", shape[0], shape[2], kv_heads, head_dim)
    elif name.startswith(("FLASH_ATTN", "TRITON_ATTN")) and len(shape) == 5 and shape[0] == 2 \
            and shape[3:] == (kv_heads, head_dim):
        return BlockLayout("flash", shape[1], shape[2], kv_heads, head_dim)
    raise ConfigError("attention backend", f"{backend} with KV tensor {list(shape)}",
                      "CPU_ATTN [blocks, heads, block, 2*dim], FLASH_ATTN/TRITON_ATTN "
                      "[2, blocks, block, heads, dim] or FLASHINFER [blocks, 2, block, heads, dim]")


def registered_layout(kv_caches: dict[str, torch.Tensor], layer_names: tuple[str, ...],
                      backend: str, kv_heads: int, head_dim: int,
                      cpu_write_op: Callable[..., None] | None = None) -> BlockLayout:
    """The layout of the KV tensors vLLM registered for ``layer_names`` (every one must be
    there), the CPU layout proven with vLLM's cache-write op when one is given."""
    from kvtier.errors import KvtierError

    missing = sorted(set(layer_names) - set(kv_caches))
    if missing:
        raise KvtierError(f"vLLM registered no KV cache for layers {missing}")
    first = kv_caches[layer_names[0]]
    layout = block_layout(backend, first, kv_heads, head_dim)
    if layout.kind == "cpu" and cpu_write_op is not None:
        check_cpu_layout(layout, first.dtype, cpu_write_op)
    return layout


def check_cpu_layout(layout: BlockLayout, dtype: torch.dtype,
                     write_op: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                         torch.Tensor], None]) -> None:
    """Write known rows through vLLM's cache-write ``write_op(key, value, key_cache,
    value_cache, slots)`` into a one-block scratch tensor and read them back through
    ``layout``; refuse the layout (naming the dtype) when they differ."""
    probe = BlockLayout("cpu", 1, layout.block_size, layout.kv_heads, layout.head_dim)
    b, h, d = probe.block_size, probe.kv_heads, probe.head_dim
    scratch = torch.zeros(1, h, b, 2 * d, dtype=dtype)
    key_cache, value_cache = scratch.view(1, h, 2 * b, d).chunk(2, dim=2)
    count = b * h * d
    keys = (torch.arange(count) % 97 + 1).to(dtype).view(b, h, d)
    values = -(torch.arange(count) % 89 + 1).to(dtype).view(b, h, d)
    write_op(keys, values, key_cache, value_cache, torch.arange(b))
    got_k, got_v = probe.read(scratch, torch.arange(b))
    if not (torch.equal(got_k, keys) and torch.equal(got_v, values)):
        raise ConfigError("kv_cache_dtype", str(dtype).removeprefix("torch."),
                          "a dtype whose CPU kernel keeps blocks as [K^T | V] per head "
                          "(float32, or bfloat16/float16 without AMX packing)")
