"""Triton kernels that move a batch of scattered pages between the device pool and the host pool.

Owns ``copy_parts_kernel`` (one launch moves every part of a ``CopyPlan``, either direction,
either host layout, any page size, any layer range) and ``launch_copy`` (picks the access width,
uploads the ids and launches on the current stream). The host pool is pinned memory that the
kernel reads or writes directly through unified addressing: Triton turns a pinned CPU tensor's
pointer into the device pointer the driver maps for it, so no staging copy and no copy engine
is involved, and one launch replaces one ``cudaMemcpy`` per page.

Bytes are bytes: the KV dtype does not matter. Parts move as 16-byte vectors (four int32 lanes)
when the part size and both base pointers allow it, else 8, 4, 2 or 1 bytes at a time. The grid
is persistent and capped (``KernelConfig.max_programs``) so a copy can be held to a share of the
multiprocessors, letting a load and a store run at once. Launched from whichever thread submits
the copy (the copy engine's caller); on the CPU it runs under ``TRITON_INTERPRET=1`` for tests.
"""

# Triton kernels take Triton values: their arguments carry no Python types.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kvtier.transfer.plan import CopyPlan, PoolGeometry
from kvtier.transfer.triton_cache import install_triton_cache

#: Programs per multiprocessor when ``KernelConfig.max_programs`` is left to the default. On the
#: H200 one direction reached the same ~51 GB/s (H2D) and ~52.5 GB/s (D2H) with anything from 16
#: to 1056 programs, and a load and a store at once reached 76-77 GB/s with one program per
#: multiprocessor each, within a few GB/s of the best split measured and well above full grids
#: (benchmarks/results/transfer_h200.txt). A copy so holds a small share of the chip.
DEFAULT_PROGRAMS_PER_SM = 1
#: Grid cap under the Triton interpreter (each program runs serially on the CPU there).
INTERPRETER_MAX_PROGRAMS = 8


@triton.jit(do_not_specialize=["n_pages", "n_layers", "layer0"])  # one compile for any batch
def copy_parts_kernel(src, dst, ids, n_pages, n_layers, layer0, chunks_per_part, part_vecs,
                      src_page, src_layer, src_part, dst_page, dst_layer, dst_part,
                      PARTS: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr):
    """Copy part ``(layer0 + l, p)`` of page ``ids[0, i]`` in ``src`` to page ``ids[1, i]`` in
    ``dst`` for every ``i < n_pages``, ``l < n_layers``, ``p < PARTS``.

    Strides are in vectors of ``VEC`` elements; a work item is one ``BLOCK``-element chunk of a
    part, and each program walks items ``pid, pid + nprog, ...`` (a persistent grid).
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_items = n_pages * n_layers * PARTS * chunks_per_part
    lanes = tl.arange(0, BLOCK)
    part_elems = part_vecs * VEC
    for item in range(pid, n_items, nprog):
        chunk = item % chunks_per_part
        rest = item // chunks_per_part
        part = (rest % PARTS).to(tl.int64)
        rest = rest // PARTS
        layer = (rest % n_layers + layer0).to(tl.int64)
        page = rest // n_layers
        src_id = tl.load(ids + page)
        dst_id = tl.load(ids + n_pages + page)
        src_base = (src_id * src_page + layer * src_layer + part * src_part) * VEC
        dst_base = (dst_id * dst_page + layer * dst_layer + part * dst_part) * VEC
        within = chunk * BLOCK + lanes
        mask = within < part_elems
        values = tl.load(src + src_base + within, mask=mask, eviction_policy="evict_first")
        tl.store(dst + dst_base + within, values, mask=mask, eviction_policy="evict_first")


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """Launch shape: bytes per work item, warps per program, and the grid cap.

    ``max_programs`` None means ``programs_per_sm`` times the device's multiprocessors; a
    smaller cap holds a copy to part of the chip (for load and store at once).
    """

    block_bytes: int = 16384
    num_warps: int = 4
    max_programs: int | None = None
    programs_per_sm: int = DEFAULT_PROGRAMS_PER_SM

    def __post_init__(self) -> None:
        if self.block_bytes < 16 or self.block_bytes & (self.block_bytes - 1):
            raise ValueError(f"block_bytes must be a power of two >= 16, got {self.block_bytes}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"num_warps must be a power of two <= 32, got {self.num_warps}")
        if self.max_programs is not None and self.max_programs < 1:
            raise ValueError(f"max_programs must be >= 1, got {self.max_programs}")


@dataclass(frozen=True, slots=True)
class _Access:
    """How the kernel touches memory: element dtype, elements per vector, elements per item."""

    dtype: torch.dtype
    vec: int
    block: int
    chunks_per_part: int
    part_vecs: int

    @property
    def vector_bytes(self) -> int:
        return self.vec * torch.empty(0, dtype=self.dtype).element_size()


def choose_access(part_bytes: int, pointers: tuple[int, ...], block_bytes: int) -> _Access:
    """The widest access (16, 8, 4, 2 or 1 bytes) that part sizes and base pointers allow.

    Every stride of both pools is a multiple of ``part_bytes``, so alignment of the part size
    and of the two base pointers is enough for every address the kernel forms.
    """
    align = part_bytes
    for ptr in pointers:
        align = _gcd_pow2(align, ptr)
    if align % 4 == 0:
        dtype, unit = torch.int32, 4
        vec = 4 if align % 16 == 0 else (2 if align % 8 == 0 else 1)
    elif align % 2 == 0:
        dtype, unit, vec = torch.int16, 2, 1
    else:
        dtype, unit, vec = torch.uint8, 1, 1
    part_elems = part_bytes // unit
    block = min(triton.next_power_of_2(part_elems), max(block_bytes // unit, vec))
    return _Access(dtype, vec, block, triton.cdiv(part_elems, block), part_elems // vec)


def _gcd_pow2(a: int, b: int) -> int:
    """Largest power of two dividing both (0 counts as divisible by anything)."""
    value = a | b
    return value & -value if value else 1 << 30


def upload_ids(plan: CopyPlan, device: torch.device) -> torch.Tensor:
    """The plan's ``[2, n]`` int64 ids on ``device``, copied on the current stream. From
    pageable memory: the driver stages the few bytes before the call returns (no stream sync),
    and no pinned byte is taken outside the pinned budget."""
    pairs = torch.from_numpy(plan.id_pairs())
    if device.type != "cuda":
        return pairs.contiguous()
    return pairs.to(device, non_blocking=True)


def launch_copy(plan: CopyPlan, device_kv: torch.Tensor, host_buffer: torch.Tensor,
                config: KernelConfig | None = None, ids: torch.Tensor | None = None) -> Any:
    """Launch one kernel that carries out ``plan`` on the current stream (returns at once).

    ``device_kv`` is the device pool tensor, ``host_buffer`` the host pool's flat uint8 buffer
    (pinned when ``device_kv`` is on CUDA). ``ids`` may be passed pre-uploaded. Returns Triton's
    handle of the compiled kernel (its ``asm`` holds the PTX), or None if nothing was launched.
    """
    if plan.num_pages == 0:
        return None
    return PreparedCopy(plan, device_kv, host_buffer, config, ids).launch()


class PreparedCopy:
    """A checked ``plan`` with its launch arguments worked out once, launched for its whole
    layer range or layer range by layer range (a layer-by-layer load: one launch per layer
    without redoing the checks each time)."""

    def __init__(self, plan: CopyPlan, device_kv: torch.Tensor, host_buffer: torch.Tensor,
                 config: KernelConfig | None = None, ids: torch.Tensor | None = None) -> None:
        install_triton_cache()
        self.plan = plan
        self.config = config = config or KernelConfig()
        host_buffer = host_buffer[:_check_buffers(plan, device_kv, host_buffer)]
        src, dst = (host_buffer, device_kv) if plan.direction == "load" else (device_kv, host_buffer)
        self.access = access = choose_access(plan.src.part_bytes, (src.data_ptr(), dst.data_ptr()),
                                             config.block_bytes)
        self.device = device_kv.device
        ids = upload_ids(plan, device_kv.device) if ids is None else ids
        self._args = (_as_elements(src, access.dtype), _as_elements(dst, access.dtype), ids)
        self._strides = (*_vector_strides(plan.src, access), *_vector_strides(plan.dst, access))

    def launch(self, layer_start: int | None = None, layer_count: int | None = None) -> Any:
        """Launch the copy of layers ``[layer_start, layer_start + layer_count)`` (default:
        the plan's) on the current stream."""
        plan, access = self.plan, self.access
        start = plan.layer_start if layer_start is None else layer_start
        count = plan.layer_count if layer_count is None else layer_count
        items = plan.num_pages * count * plan.src.parts * access.chunks_per_part
        grid = (_grid_size(items, self.config, self.device),)
        try:
            return copy_parts_kernel[grid](
                *self._args, plan.num_pages, count, start, access.chunks_per_part,
                access.part_vecs, *self._strides, PARTS=plan.src.parts, VEC=access.vec,
                BLOCK=access.block, num_warps=self.config.num_warps)
        except ValueError as exc:  # Triton found no device mapping for a pointer
            if "cannot be accessed" not in str(exc):
                raise
            raise ValueError("the host pool buffer is not mapped into the device's address "
                             "space: it must be pinned (page-locked) host memory") from exc


def _vector_strides(geometry: PoolGeometry, access: _Access) -> tuple[int, int, int]:
    size = access.vector_bytes
    return (geometry.page_stride // size, geometry.layer_stride // size,
            geometry.part_stride // size)


def _as_elements(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    flat = tensor.reshape(-1).view(torch.uint8)
    return flat if dtype == torch.uint8 else flat.view(dtype)


def _grid_size(items: int, config: KernelConfig, device: torch.device) -> int:
    if config.max_programs is not None:
        cap = config.max_programs
    elif device.type == "cuda":
        cap = config.programs_per_sm * multiprocessor_count(device.index or 0)
    else:
        cap = INTERPRETER_MAX_PROGRAMS
    return max(1, min(items, cap))


@functools.cache
def multiprocessor_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (looked up once per device)."""
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def _check_buffers(plan: CopyPlan, device_kv: torch.Tensor, host_buffer: torch.Tensor) -> int:
    """Raise unless both buffers fit the plan; returns the host bytes the geometry spans.

    Whether the host buffer is pinned is left to the launch: ``Tensor.is_pinned`` answers False
    for memory pinned with ``cudaHostRegister``, while Triton asks the driver for the device
    mapping of every pointer and refuses one that has none.
    """
    device_geo = plan.dst if plan.direction == "load" else plan.src
    host_geo = plan.src if plan.direction == "load" else plan.dst
    if not device_kv.is_contiguous():
        raise ValueError("the device pool tensor must be contiguous")
    if device_kv.numel() * device_kv.element_size() != device_geo.nbytes:
        raise ValueError(f"device pool tensor holds {device_kv.numel() * device_kv.element_size()} "
                         f"bytes, its geometry {device_geo.nbytes}")
    if host_buffer.dtype != torch.uint8 or host_buffer.dim() != 1:
        raise ValueError("the host pool buffer must be a flat uint8 tensor")
    if host_buffer.numel() < host_geo.nbytes:
        raise ValueError(f"host buffer holds {host_buffer.numel()} bytes, its geometry needs "
                         f"{host_geo.nbytes}")
    return host_geo.nbytes
