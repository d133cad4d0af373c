"""How token K/V rows sit inside vLLM's per-layer paged KV tensors, and how to move them.

Owns ``BlockLayout`` and its two kinds, picked by ``block_layout()`` from the attention
backend's name and the tensor vLLM registered (its shape, which ``compat.check_kv_shape``
holds against what vLLM's own code says the backend allocates, and its strides):

- ``strided``: FLASH_ATTN, FLASHINFER and TRITON_ATTN. Every supported vLLM gives each layer a
  tensor of logical shape ``[num_blocks, kv_heads, block_size, 2 * head_dim]``, each head's row
  holding K then V, but the order in memory is vLLM's choice (tokens outer by default, heads
  outer when ``VLLM_KV_CACHE_LAYOUT`` or a connector asks for HND, blocks inner for cross-layer
  layouts). The layout keeps the tensor's own strides, as ``[block, K|V, token, head, dim]``,
  so every order reads right, and whole blocks move with ``transfer.rows``' kernel wherever
  the head dimension is contiguous.
- ``cpu``: vLLM's CPU backend, the same logical shape, contiguous. Inside a block each head
  holds K transposed (``[head_dim, block_size]``) and then V (``[block_size, head_dim]``); that
  is how its ``vec``/``vec16`` kernels write them. ``check_cpu_layout`` proves it at start
  with vLLM's own cache-write op, so a kernel that packs blocks differently (``amx`` for bf16
  on AMX machines) is refused instead of read wrongly.

Anything else (another shape, another backend) is refused at start, naming what was found.
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
from kvtier.transfer.rows import RowGeometry

KINDS = ("strided", "cpu")
#: Attention backends whose per-layer cache is ``[blocks, heads, tokens, K|V]`` with K and V side
#: by side in each head's row, in whatever stride order vLLM allocated (``strided``).
PACKED_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")


@dataclass(frozen=True)
class BlockLayout:
    """Geometry of one layer's paged KV tensor of one attention backend.

    ``strides`` (kind ``strided``): element strides of ``[block, K|V, token, head, dim]`` in
    vLLM's tensor, read from the tensor itself; ``name`` says which order that is."""

    kind: str
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    strides: tuple[int, ...] = ()
    name: str = ""

    def views(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as views indexed ``[block, offset]`` -> ``[heads, head_dim]`` rows."""
        n, b, h, d = self.num_blocks, self.block_size, self.kv_heads, self.head_dim
        if self.kind == "cpu":
            halves = kv.view(n, h, 2, b * d)
            k = halves[:, :, 0].unflatten(-1, (d, b)).permute(0, 3, 1, 2)   # [n, b, h, d]
            v = halves[:, :, 1].unflatten(-1, (b, d)).permute(0, 2, 1, 3)
            return k, v
        five = kv.as_strided((n, 2, b, h, d), self.strides, kv.storage_offset())
        return five[:, 0], five[:, 1]

    def read(self, kv: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows of ``slots`` as two ``[len(slots), kv_heads, head_dim]`` tensors."""
        k, v = self.views(kv)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        return k[blocks, offsets], v[blocks, offsets]

    def read_blocks(self, kv: torch.Tensor,
                    block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks as two ``[len(block_ids), block_size, kv_heads, head_dim]``
        views of one gathered copy (a block gather, then no per-token indexing)."""
        if self.kind == "cpu":
            gathered = kv.index_select(0, block_ids)
            return BlockLayout(self.kind, len(block_ids), self.block_size, self.kv_heads,
                               self.head_dim).views(gathered)
        n, b, h, d = self.num_blocks, self.block_size, self.kv_heads, self.head_dim
        gathered = kv.as_strided((n, 2, b, h, d), self.strides,
                                 kv.storage_offset()).index_select(0, block_ids)
        return gathered[:, 0], gathered[:, 1]

    def write(self, kv: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor) -> None:
        """Store ``[len(slots), kv_heads, head_dim]`` K and V rows at ``slots``."""
        k, v = self.views(kv)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        k[blocks, offsets] = keys.to(k.dtype)
        v[blocks, offsets] = values.to(v.dtype)

    def rows(self) -> RowGeometry | None:
        """The tensor as blocks of head-dim rows for ``transfer.rows`` (None: the head
        dimension is not contiguous, or the CPU backend's transposed K)."""
        if self.kind != "strided" or self.strides[4] != 1:
            return None
        block, part, token, head, _ = self.strides
        return RowGeometry(self.num_blocks, self.block_size, self.kv_heads, self.head_dim,
                           block, part, token, head)


def packed_layout(kv: torch.Tensor, kv_heads: int, head_dim: int) -> BlockLayout:
    """The ``strided`` layout of a ``[blocks, heads, tokens, 2 * head_dim]`` tensor (K in the
    first half of each row, V in the second), in the stride order vLLM gave it."""
    n, h, b, _ = kv.shape
    s_block, s_head, s_token, s_dim = kv.stride()
    strides = (s_block, head_dim * s_dim, s_token, s_head, s_dim)
    order = "tokens outer (NHD)" if s_token > s_head else "heads outer (HND)"
    if s_block < max(s_head * h, s_token * b):
        order += ", blocks not outermost"
    return BlockLayout("strided", n, b, kv_heads, head_dim, strides,
                       f"[blocks, heads, tokens, K|V] strides {list(kv.stride())}, {order}")


def block_layout(backend: str, kv: torch.Tensor, kv_heads: int, head_dim: int,
                 block_size: int | None = None) -> BlockLayout:
    """The layout of ``kv`` (one layer's tensor) for attention backend ``backend``: vLLM's
    logical ``[blocks, heads, tokens, 2 * head_dim]`` (``block_size`` tokens a block when
    given), refused otherwise naming what was found."""
    shape = tuple(kv.shape)
    name = backend.upper()
    fits = len(shape) == 4 and shape[1] == kv_heads and shape[3] == 2 * head_dim \
        and (block_size is None or shape[2] == block_size)
    if fits and name.startswith("CPU"):
        n, h, b, c = shape
        if kv.stride() == (h * b * c, b * c, c, 1):
            return BlockLayout("cpu", n, b, kv_heads, head_dim)
    elif fits and name.startswith(PACKED_BACKENDS):
        return packed_layout(kv, kv_heads, head_dim)
    raise ConfigError("attention backend", f"{backend} with KV tensor {list(shape)} strides "
                      f"{list(kv.stride())}",
                      f"{'/'.join(PACKED_BACKENDS)} or CPU_ATTN (contiguous) with vLLM's "
                      f"[blocks, {kv_heads} heads, {block_size or 'block'} tokens, "
                      f"{2 * head_dim}] per layer")


def registered_layout(kv_caches: dict[str, torch.Tensor], layer_names: tuple[str, ...],
                      backend: str, kv_heads: int, head_dim: int,
                      cpu_write_op: Callable[..., None] | None = None,
                      block_size: int | None = None) -> BlockLayout:
    """The layout of the KV tensors vLLM registered for ``layer_names`` (every one must be
    there, all laid out alike), the CPU layout proven with vLLM's cache-write op when one is
    given."""
    from kvtier.errors import KvtierError

    missing = sorted(set(layer_names) - set(kv_caches))
    if missing:
        raise KvtierError(f"vLLM registered no KV cache for layers {missing}")
    first = kv_caches[layer_names[0]]
    layout = block_layout(backend, first, kv_heads, head_dim, block_size)
    for name in layer_names[1:]:
        other = block_layout(backend, kv_caches[name], kv_heads, head_dim, block_size)
        if other != layout:
            raise ConfigError("KV cache layout", f"layer {name}: {other.name or other.kind}",
                              f"the layout of layer {layer_names[0]}: {layout.name or layout.kind}")
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
