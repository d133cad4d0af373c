"""A Triton kernel that moves whole KV blocks between two strided layouts, head-dim row by row.

Owns ``RowGeometry`` (where row ``(block, part, token, head)`` of one layer starts, in elements),
``RowPlan`` (a checked batch of block pairs) and ``RowCopy`` (the launch). It serves KV tensors
whose K and V are not contiguous parts of a block: an engine that packs K and V side by side in
each head's row (vLLM's ``[blocks, heads, tokens, 2 * head_dim]``, tokens or heads outer in
memory) or that keeps a layer's heads apart across blocks. Only the head dimension must be
contiguous; everything else is a stride, read from the engine's own tensor, so one kernel
covers every layout such an engine may choose, and no staging copy or per-token index is formed.

Either side may be pinned host memory, which the kernel reads or writes through unified
addressing (the table holds the driver's mapping of it). A copy may span layers: each side's
layers come as a table of their byte addresses (an engine's layers are separate tensors,
anywhere in memory, of one geometry), so one launch moves a request's blocks in every layer
rather than one launch per layer. A work item is ``ROWS``
consecutive rows (``token * heads + head``) of one part of one block pair of one layer: a
``[ROWS, COLS]`` tile loaded and stored once. Bytes are bytes: the copy runs in the widest
integer unit (8, 4, 2 or 1 bytes) that divides the row size, every stride and every layer's
base address. The grid is persistent and capped like ``transfer.kernels``' copies. Launched on the
caller's current stream from the thread that owns the copy (an engine's model-runner thread);
on the CPU it runs under ``TRITON_INTERPRET=1`` for tests.
"""

# Triton kernels take Triton values: their arguments carry no Python types.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from kvtier.transfer.kernels import INTERPRETER_MAX_PROGRAMS, multiprocessor_count
from kvtier.transfer.triton_cache import install_triton_cache

#: Bytes one work item moves (a tile of rows). 16 KiB matches ``KernelConfig.block_bytes`` of
#: the page copies: large enough that each program keeps many loads in flight, small enough that
#: a 16-token block of 8 heads of 128 bf16 (32 KiB a part) still splits over two programs.
TILE_BYTES = 16384
UNITS = (torch.int64, torch.int32, torch.int16, torch.uint8)


@triton.jit
def _layer_base(table, layer, UNIT_BYTES: tl.constexpr):
    """Layer ``layer``'s first element, from a table of byte addresses, as a pointer to units."""
    address = tl.load(table + layer)
    if UNIT_BYTES == 8:
        base = address.to(tl.pointer_type(tl.int64))
    elif UNIT_BYTES == 4:
        base = address.to(tl.pointer_type(tl.int32))
    elif UNIT_BYTES == 2:
        base = address.to(tl.pointer_type(tl.int16))
    else:
        base = address.to(tl.pointer_type(tl.uint8))
    return base


@triton.jit(do_not_specialize=["n_pairs", "n_layers"])
def copy_rows_kernel(src_layers, dst_layers, ids, n_pairs, n_layers, rows_per_part, heads,
                     row_len, chunks, src_block, src_part, src_token, src_head,
                     dst_block, dst_part, dst_token, dst_head,
                     UNIT_BYTES: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """For every layer ``l < n_layers``, copy every row of both parts of block ``ids[0, i]``
    of the layer at ``src_layers[l]`` to block ``ids[1, i]`` of the layer at
    ``dst_layers[l]``, ``i < n_pairs``. Strides and ``row_len`` are in the copy's unit."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    per_layer = n_pairs * 2 * chunks
    n_items = per_layer * n_layers
    lanes = tl.arange(0, ROWS)
    cols = tl.arange(0, COLS)
    for item in range(pid, n_items, nprog):
        layer = item // per_layer
        within = item % per_layer
        chunk = within % chunks
        rest = within // chunks
        part = (rest % 2).to(tl.int64)
        pair = rest // 2
        src = _layer_base(src_layers, layer, UNIT_BYTES)
        dst = _layer_base(dst_layers, layer, UNIT_BYTES)
        src_id = tl.load(ids + pair).to(tl.int64)
        dst_id = tl.load(ids + n_pairs + pair).to(tl.int64)
        rows = chunk * ROWS + lanes
        token = (rows // heads).to(tl.int64)
        head = (rows % heads).to(tl.int64)
        src_at = src_id * src_block + part * src_part + token * src_token + head * src_head
        dst_at = dst_id * dst_block + part * dst_part + token * dst_token + head * dst_head
        mask = (rows < rows_per_part)[:, None] & (cols < row_len)[None, :]
        values = tl.load(src + src_at[:, None] + cols[None, :], mask=mask,
                         eviction_policy="evict_first")
        tl.store(dst + dst_at[:, None] + cols[None, :], values, mask=mask,
                 eviction_policy="evict_first")


@dataclass(frozen=True)
class RowGeometry:
    """One layer of a KV tensor as blocks of rows: row ``(block, part, token, head)`` starts
    ``block * block_stride + part * part_stride + token * token_stride + head * head_stride``
    elements after the layer's first element and holds ``head_dim`` contiguous elements."""

    num_blocks: int
    block_size: int
    heads: int
    head_dim: int
    block_stride: int
    part_stride: int
    token_stride: int
    head_stride: int

    def strides(self) -> tuple[int, int, int, int]:
        return self.block_stride, self.part_stride, self.token_stride, self.head_stride

    def extent(self) -> int:
        """Elements from the layer's first element to the end of its last row."""
        last = (self.num_blocks - 1) * self.block_stride + self.part_stride \
            + (self.block_size - 1) * self.token_stride + (self.heads - 1) * self.head_stride
        return last + self.head_dim if self.num_blocks else 0

    def same_rows(self, other: RowGeometry) -> bool:
        return (self.block_size, self.heads, self.head_dim) == \
            (other.block_size, other.heads, other.head_dim)


@dataclass(frozen=True)
class RowPlan:
    """Block pairs to copy: ``src_ids[i]`` of the source to ``dst_ids[i]`` of the destination."""

    src_ids: np.ndarray
    dst_ids: np.ndarray

    @property
    def num_blocks(self) -> int:
        return len(self.src_ids)

    def id_pairs(self) -> np.ndarray:
        return np.stack([self.src_ids, self.dst_ids]).astype(np.int64)


def make_row_plan(src: RowGeometry, dst: RowGeometry, src_ids: Any, dst_ids: Any) -> RowPlan:
    """A checked plan: ids in range, as many sources as destinations, no destination twice,
    and both sides rows of the same shape (raises ``ValueError`` before anything moves)."""
    s = np.asarray(src_ids, dtype=np.int64).reshape(-1)
    d = np.asarray(dst_ids, dtype=np.int64).reshape(-1)
    if not src.same_rows(dst):
        raise ValueError(f"blocks of {src} cannot be copied into blocks of {dst}")
    if len(s) != len(d):
        raise ValueError(f"{len(s)} source blocks for {len(d)} destination blocks")
    for name, ids, geo in (("source", s, src), ("destination", d, dst)):
        if len(ids) and (ids.min() < 0 or ids.max() >= geo.num_blocks):
            raise ValueError(f"{name} block id out of range [0, {geo.num_blocks})")
    if len(np.unique(d)) != len(d):
        raise ValueError("a destination block appears twice in one copy")
    return RowPlan(s, d)


def upload_pairs(plan: RowPlan, device: torch.device) -> torch.Tensor:
    """The plan's ``[2, n]`` ids on ``device`` (from pageable memory, on the current stream)."""
    pairs = torch.from_numpy(plan.id_pairs())
    return pairs.to(device, non_blocking=True) if device.type == "cuda" else pairs


def copy_unit(row_bytes: int, byte_strides: tuple[int, ...], pointers: tuple[int, ...]) -> torch.dtype:
    """The widest integer type dividing the row size, every stride and both base addresses."""
    for unit in UNITS:
        size = torch.empty(0, dtype=unit).element_size()
        if all(v % size == 0 for v in (row_bytes, *byte_strides, *pointers)):
            return unit
    return torch.uint8


class RowCopy:
    """Copies between one source and one destination geometry (any dtype, same element size),
    each layer's tensor seen from its first element. ``bind(src, dst)`` checks a pair of layer
    lists once and returns a ``BoundRowCopy`` whose launches do nothing but launch: one launch
    moves the plan's blocks in every layer bound."""

    def __init__(self, src_geometry: RowGeometry, dst_geometry: RowGeometry,
                 max_programs: int | None = None, programs_per_sm: int = 1) -> None:
        install_triton_cache()
        self.src_geometry = src_geometry
        self.dst_geometry = dst_geometry
        self.max_programs = max_programs
        self.programs_per_sm = programs_per_sm

    def bind(self, src: torch.Tensor | Sequence[torch.Tensor],
             dst: torch.Tensor | Sequence[torch.Tensor]) -> BoundRowCopy:
        """The launch arguments for copies from ``src`` to ``dst``: one tensor each, or a list
        of layers each, as many on both sides (checked here, once)."""
        srcs = [src] if isinstance(src, torch.Tensor) else list(src)
        dsts = [dst] if isinstance(dst, torch.Tensor) else list(dst)
        if not srcs or len(srcs) != len(dsts):
            raise ValueError(f"{len(srcs)} source layers for {len(dsts)} destination layers")
        size = srcs[0].element_size()
        # One side may be host memory the GPU maps (pinned): the copy runs on the other's GPU.
        device = next((t.device for t in (*dsts, *srcs) if t.device.type == "cuda"),
                      dsts[0].device)
        sg, dg = self.src_geometry, self.dst_geometry
        for name, tensors, geometry in (("source", srcs, sg), ("destination", dsts, dg)):
            sides = {t.device for t in tensors}
            if len(sides) > 1 or (sides != {device} and sides != {torch.device("cpu")}):
                raise ValueError(f"the {name} layers are on {sorted(map(str, sides))}, "
                                 f"not {device} or mapped host memory")
            for tensor in tensors:
                if tensor.element_size() != size:
                    raise ValueError(f"element sizes differ: {srcs[0].dtype} and {tensor.dtype}")
                room = tensor.untyped_storage().nbytes() - tensor.storage_offset() * size
                if geometry.extent() * size > room:
                    raise ValueError(f"a {name} tensor holds {room} bytes from its first "
                                     f"element, its geometry spans {geometry.extent() * size}")
        strides = tuple(s * size for s in (*sg.strides(), *dg.strides()))
        pointers = tuple(t.data_ptr() for t in (*srcs, *dsts))
        unit = copy_unit(sg.head_dim * size, strides, pointers)
        width = torch.empty(0, dtype=unit).element_size()
        row_len = sg.head_dim * size // width
        cols = triton.next_power_of_2(row_len)
        rows = max(1, min(triton.next_power_of_2(sg.block_size * sg.heads),
                          TILE_BYTES // (cols * width)))
        rows_per_part = sg.block_size * sg.heads
        chunks = triton.cdiv(rows_per_part, rows)
        return BoundRowCopy(
            (*srcs, *dsts), _addresses(srcs, device), _addresses(dsts, device), len(srcs),
            device, chunks, (rows_per_part, sg.heads, row_len, chunks,
                             *(s // width for s in strides)),
            {"UNIT_BYTES": width, "ROWS": rows, "COLS": cols, "num_warps": 4},
            self._cap(device))

    def _cap(self, device: torch.device) -> int:
        if self.max_programs is not None:
            return self.max_programs
        if device.type == "cuda":
            return self.programs_per_sm * multiprocessor_count(device.index or 0)
        return INTERPRETER_MAX_PROGRAMS


@dataclass(frozen=True)
class BoundRowCopy:
    """Source and destination layers with their launch arguments worked out."""

    tensors: tuple[torch.Tensor, ...]   # held, so the addresses stay theirs
    src_layers: torch.Tensor            # each source layer's byte address, on ``device``
    dst_layers: torch.Tensor
    num_layers: int
    device: torch.device
    chunks: int
    args: tuple[int, ...]
    constants: dict[str, int]
    max_programs: int

    def launch(self, plan: RowPlan, ids: torch.Tensor | None = None) -> None:
        """Copy ``plan``'s block pairs in every bound layer on the current stream (returns at
        once on CUDA). ``ids``: ``upload_pairs(plan)`` made before (one upload serves every
        launch)."""
        if plan.num_blocks == 0:
            return
        ids = upload_pairs(plan, self.device) if ids is None else ids
        items = plan.num_blocks * 2 * self.chunks * self.num_layers
        grid = (max(1, min(items, self.max_programs)),)
        copy_rows_kernel[grid](self.src_layers, self.dst_layers, ids, plan.num_blocks,
                               self.num_layers, *self.args, **self.constants)


def _addresses(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Each tensor's first byte's address as ``device`` sees it, as an int64 tensor on
    ``device`` (uploaded without waiting for the stream)."""
    mapped = device.type == "cuda"
    table = torch.tensor([device_address(t) if mapped else t.data_ptr() for t in tensors],
                         dtype=torch.int64, pin_memory=mapped)
    return table.to(device, non_blocking=True)


def device_address(tensor: torch.Tensor) -> int:
    """The address a GPU kernel uses for ``tensor``'s first byte: its own on the GPU; for
    pinned host memory the driver's mapping of it (``cuPointerGetAttribute``; registered
    memory may be mapped elsewhere than its host address). Host memory the driver does not map
    is refused here, before any kernel could fault on it."""
    if tensor.device.type == "cuda":
        return int(tensor.data_ptr())
    import ctypes

    driver = ctypes.CDLL("libcuda.so.1")
    out = ctypes.c_uint64()
    device_pointer = 3                      # CU_POINTER_ATTRIBUTE_DEVICE_POINTER
    status = driver.cuPointerGetAttribute(ctypes.byref(out), device_pointer,
                                          ctypes.c_uint64(tensor.data_ptr()))
    if status != 0:
        raise ValueError(f"host memory at {tensor.data_ptr():#x} is not mapped for the GPU "
                         f"(cuPointerGetAttribute: {status}); pin it first")
    return int(out.value)
