"""The copy engines, many copies per call: a binding of the CUDA driver's ``cuMemcpyBatchAsync``.

Owns ``BatchCopy`` (``copy(dsts, srcs, sizes, stream)``: byte ranges as numpy uint64 arrays of
addresses, enqueued on ``stream`` in stream order) and ``load_batch_copy`` (the driver's entry
point, asked for by ABI version 12.8 through ``cuGetProcAddress``; None where the driver has none,
e.g. without CUDA or before 12.8). The driver refuses the legacy default stream: callers pass a
created stream. Any thread; the driver call only enqueues.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import numpy as np

_ABI_VERSION = 12080
_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: sources are read in stream order


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


RawCopy = Callable[[np.ndarray, np.ndarray, np.ndarray, int], None]


class BatchCopy:
    """Enqueues batches of byte copies; ``raw`` does the enqueuing (the driver, or a stand-in
    with the same arguments in tests)."""

    def __init__(self, raw: RawCopy, name: str = "cuMemcpyBatchAsync") -> None:
        self._raw = raw
        self.name = name
        self.calls = 0
        self.copies = 0

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        """Copy ``sizes[i]`` bytes from address ``srcs[i]`` to ``dsts[i]`` for every ``i``."""
        if not dsts.size:
            return
        if not dsts.size == srcs.size == sizes.size:
            raise ValueError(f"{dsts.size} destinations, {srcs.size} sources, {sizes.size} sizes")
        self._raw(np.ascontiguousarray(dsts, np.uint64), np.ascontiguousarray(srcs, np.uint64),
                  np.ascontiguousarray(sizes, np.uint64), stream)
        self.calls += 1
        self.copies += int(dsts.size)


def _driver_copy(fn: Callable[..., int]) -> RawCopy:
    attrs = _MemcpyAttributes(_ORDER_STREAM, _MemLocation(0, 0), _MemLocation(0, 0), 0)
    attr_index = np.zeros(1, dtype=np.uint64)

    def raw(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        if not stream:
            raise ValueError("cuMemcpyBatchAsync refuses the legacy default stream")
        failed = ctypes.c_size_t(0)
        err = fn(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, dsts.size,
                 ctypes.byref(attrs), attr_index.ctypes.data, 1, ctypes.byref(failed), stream)
        if err:
            raise RuntimeError(f"cuMemcpyBatchAsync failed with CUresult {err} at copy "
                               f"{failed.value} of {dsts.size}")
    return raw


@functools.cache
def load_batch_copy() -> BatchCopy | None:
    """The driver's batched copy, or None where it is missing (no driver, or older than 12.8)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        get = lib.cuGetProcAddress_v2
    except (OSError, AttributeError):
        return None
    get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                    ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
    pointer, status = ctypes.c_void_p(), ctypes.c_int()
    if get(b"cuMemcpyBatchAsync", ctypes.byref(pointer), _ABI_VERSION, 0, ctypes.byref(status)) \
            or not pointer.value:
        return None
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_size_t, ctypes.POINTER(_MemcpyAttributes), ctypes.c_void_p,
                             ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p)
    return BatchCopy(_driver_copy(proto(pointer.value)))


def host_memmove() -> BatchCopy:
    """A synchronous stand-in over host memory (``ctypes.memmove``), for the CPU and tests."""
    def raw(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
            ctypes.memmove(dst, src, size)
    return BatchCopy(raw, "memmove")
