"""Where each part of a page lives in a pool's bytes, and the checks every copy passes first.

Owns ``PoolGeometry`` (byte strides of one pool: device, host ``page_first``, host
``layer_first``) and ``CopyPlan`` (a validated batch: source ids, destination ids, layer range,
and the two geometries). A plan is built on the calling thread before anything is launched, so a
bad page id, a repeated destination or a layout that does not match is a clear exception and no
byte is written. Needs numpy only (no torch, no triton).

Part ``p`` of layer ``l`` of page ``i`` starts at
``i * page_stride + l * layer_stride + p * part_stride`` bytes into the pool's flat buffer and is
``part_bytes`` long. Every copy between tiers moves whole parts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias, cast

import numpy as np

from kvtier.errors import LayoutMismatch
from kvtier.layout import KVLayout

if TYPE_CHECKING:
    import torch

#: Page ids of a copy: a sequence of ints (list, range), a numpy array or a CPU tensor.
PageIds: TypeAlias = "Sequence[int] | np.ndarray | torch.Tensor"

HOST_LAYOUT_NAMES: tuple[str, ...] = ("page_first", "layer_first")
DIRECTIONS: tuple[str, ...] = ("load", "store")


@dataclass(frozen=True, slots=True)
class PoolGeometry:
    """Byte strides of the parts of one pool; ``name`` is for messages."""

    name: str
    num_pages: int
    part_bytes: int
    num_layers: int
    parts: int
    page_stride: int
    layer_stride: int
    part_stride: int

    @property
    def nbytes(self) -> int:
        """Bytes from the pool's start to the end of its last part (its buffer's least size)."""
        if self.num_pages == 0:
            return 0
        return self.part_offset(self.num_pages - 1, self.num_layers - 1, self.parts - 1) \
            + self.part_bytes

    def part_offset(self, page: int, layer: int, part: int) -> int:
        return page * self.page_stride + layer * self.layer_stride + part * self.part_stride


def device_geometry(layout: KVLayout, num_pages: int) -> PoolGeometry:
    """The device pool ``kv[num_layers, parts, num_pages, page_size, heads, head_dim]``."""
    part = layout.part_bytes
    return PoolGeometry("device", num_pages, part, layout.num_layers, layout.parts,
                        page_stride=part, layer_stride=layout.parts * num_pages * part,
                        part_stride=num_pages * part)


def host_geometry(layout: KVLayout, num_pages: int, host_layout: str) -> PoolGeometry:
    """The host pool in ``page_first`` or ``layer_first`` order (docs/architecture.md)."""
    part = layout.part_bytes
    if host_layout == "page_first":
        return PoolGeometry("host", num_pages, part, layout.num_layers, layout.parts,
                            page_stride=layout.page_bytes, layer_stride=layout.layer_bytes,
                            part_stride=part)
    if host_layout == "layer_first":
        return PoolGeometry("host", num_pages, part, layout.num_layers, layout.parts,
                            page_stride=layout.layer_bytes,
                            layer_stride=num_pages * layout.layer_bytes, part_stride=part)
    raise ValueError(f"unknown host layout {host_layout!r}; expected one of {HOST_LAYOUT_NAMES}")


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """A checked batch: part ``(layer, p)`` of ``src_ids[i]`` goes to ``dst_ids[i]``."""

    direction: str
    src: PoolGeometry
    dst: PoolGeometry
    src_ids: np.ndarray
    dst_ids: np.ndarray
    layer_start: int
    layer_count: int

    @property
    def num_pages(self) -> int:
        return int(self.src_ids.size)

    @property
    def nbytes(self) -> int:
        """Bytes this plan moves."""
        return self.num_pages * self.layer_count * self.src.parts * self.src.part_bytes

    def id_pairs(self) -> np.ndarray:
        """``[2, n]`` int64: row 0 the source ids, row 1 the destination ids."""
        return np.stack([self.src_ids, self.dst_ids])


def as_page_ids(ids: PageIds, what: str) -> np.ndarray:
    """Page ids as a 1-D int64 array (from a list, range, numpy array or CPU tensor)."""
    if hasattr(ids, "detach"):  # a torch tensor (this module does not import torch)
        tensor = cast("torch.Tensor", ids)
        if tensor.device.type != "cpu":
            raise ValueError(f"{what}: page ids must be on the CPU, got a {tensor.device} tensor")
        ids = tensor.detach().numpy()
    arr = np.asarray(ids)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"{what}: page ids must be a 1-D sequence of integers, got {arr.dtype} "
                         f"with shape {arr.shape}")
    return arr.astype(np.int64, copy=False)


def check_ids_in_range(ids: np.ndarray, num_pages: int, what: str) -> None:
    """Raise ``IndexError`` naming the first id outside ``[0, num_pages)``."""
    if ids.size == 0:
        return
    bad = np.flatnonzero((ids < 0) | (ids >= num_pages))
    if bad.size:
        first = int(bad[0])
        raise IndexError(f"{what} page id {int(ids[first])} at position {first} is outside "
                         f"[0, {num_pages}) ({bad.size} bad ids in the batch)")


def check_unique(ids: np.ndarray, what: str) -> None:
    """Two writes to one page in one batch would race: refuse them."""
    if ids.size < 2:
        return
    ordered = np.sort(ids)
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if repeated.size:
        raise ValueError(f"{what} page id {int(repeated[0])} appears more than once in one batch")


def layer_range(layers: int | Sequence[int] | range | None, num_layers: int) -> tuple[int, int]:
    """``(start, count)`` of a contiguous layer range: None (all), an int, or a range/sequence."""
    if layers is None:
        return 0, num_layers
    if isinstance(layers, bool):
        raise TypeError(f"layers must be an int, a sequence of ints or None, got {layers!r}")
    if isinstance(layers, (int, np.integer)):
        start, stop = int(layers), int(layers) + 1
    else:
        seq = list(layers)
        if not seq:
            raise ValueError("an empty layer selection moves nothing; pass None for all layers")
        start, stop = int(seq[0]), int(seq[-1]) + 1
        if seq != list(range(start, stop)):
            raise ValueError(f"layers must be contiguous and increasing, got {seq}")
    if not 0 <= start < stop <= num_layers:
        raise IndexError(f"layers [{start}, {stop}) outside [0, {num_layers})")
    return start, stop - start


def check_same_shape(src: PoolGeometry, dst: PoolGeometry) -> None:
    if (src.part_bytes, src.num_layers, src.parts) != (dst.part_bytes, dst.num_layers, dst.parts):
        raise LayoutMismatch(
            f"{src.name} pool has {src.num_layers} layers x {src.parts} parts of {src.part_bytes} "
            f"bytes, {dst.name} pool {dst.num_layers} x {dst.parts} of {dst.part_bytes}")


def make_plan(direction: str, src: PoolGeometry, dst: PoolGeometry, src_ids: PageIds,
              dst_ids: PageIds,
              layers: int | Sequence[int] | range | None = None) -> CopyPlan:
    """Check a batch and return its plan; raises before anything moves."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    check_same_shape(src, dst)
    src_arr = as_page_ids(src_ids, f"{src.name} (source)")
    dst_arr = as_page_ids(dst_ids, f"{dst.name} (destination)")
    if src_arr.size != dst_arr.size:
        raise ValueError(f"{src_arr.size} source page ids but {dst_arr.size} destination ids")
    check_ids_in_range(src_arr, src.num_pages, f"{src.name} (source)")
    check_ids_in_range(dst_arr, dst.num_pages, f"{dst.name} (destination)")
    check_unique(dst_arr, f"{dst.name} (destination)")
    start, count = layer_range(layers, src.num_layers)
    return CopyPlan(direction, src, dst, src_arr, dst_arr, start, count)
