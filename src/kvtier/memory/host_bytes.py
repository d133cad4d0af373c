"""Host buffers leased from the ``PinnedBudget``: page-aligned, pinned when CUDA is present.

Owns ``allocate_host_bytes`` and ``HostBytes``, the one place kvtier allocates host memory for
pages (host pool, read ring). The bytes are reserved first, then allocated; closing a buffer
unpins it and gives the bytes back.

Pinning registers a page-aligned allocation with the CUDA driver (``cudaHostRegister``) instead of
going through torch's caching pinned allocator, which rounds every request up to a power of two
and keeps freed blocks pinned (both measured: benchmarks/results/pinned_gpu.txt). With
registration the bytes pinned are exactly the bytes reserved. When registration is refused the
buffer falls back to torch's allocator, leases the rounded size and says so
(``HostBytes.method``). Without CUDA the same ledger is kept for plain memory, so accounting
behaves the same on every machine. Called on whichever thread builds a pool or ring.
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING

from kvtier.errors import CapacityError, ConfigError
from kvtier.memory.pinned import PinnedBudget, PinnedLease

if TYPE_CHECKING:
    import torch

#: Host buffers start on an OS page boundary: aligned reads (O_DIRECT, preadv) land at full speed.
HOST_ALIGN_BYTES = 4096


def cuda_present() -> bool:
    """Whether torch sees a CUDA device (host buffers are pinned only then)."""
    import torch

    return bool(torch.cuda.is_available())


def resolve_pin(pin: bool | None) -> bool:
    """``None`` pins when CUDA is present; ``True`` without CUDA is a configuration error."""
    present = cuda_present()
    if pin is None:
        return present
    if pin and not present:
        raise ConfigError("pin", pin, "False or None (auto) on a machine without CUDA")
    return bool(pin)


class HostBytes:
    """A host buffer of ``nbytes`` (``tensor``, flat uint8) whose bytes are leased from a budget.

    ``method`` says how it was allocated: ``registered`` (cudaHostRegister: exactly ``nbytes``
    pinned; torch's ``is_pinned()`` reports False for such memory, ``pinned`` is the truth),
    ``torch_pinned`` (torch's allocator, the fallback when registration is refused; its
    power-of-two rounding is leased too) or ``pageable``. ``close()`` unpins and releases the
    leases; a buffer dropped without ``close()`` is unpinned and released when collected, so
    a registration never outlives its owner and freed memory is never left pinned.
    """

    def __init__(self, tensor: torch.Tensor, nbytes: int, leases: tuple[PinnedLease, ...],
                 method: str, backing: torch.Tensor | None = None, registered_ptr: int = 0) -> None:
        self.tensor: torch.Tensor | None = tensor  # None once closed
        self.nbytes = nbytes
        self.lease = leases[0]
        self.method = method
        self._backing = backing
        self._finish_args = (registered_ptr, leases, method == "torch_pinned")
        self._finalizer = weakref.finalize(self, _finish, *self._finish_args, strict=False)

    @property
    def pinned(self) -> bool:
        return self.method != "pageable"

    @property
    def leased_bytes(self) -> int:
        """Bytes this buffer holds in the budget (more than ``nbytes`` for ``torch_pinned``)."""
        return sum(lease.nbytes for lease in self._finish_args[1])

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Unpin (if registered), drop the memory and release the leases; idempotent."""
        if self._finalizer.detach() is None:
            return
        if self.method != "registered":
            self.tensor = self._backing = None  # torch's cache can only free unreferenced blocks
        try:
            _finish(*self._finish_args, strict=True)
        finally:
            self.tensor = self._backing = None

    def __enter__(self) -> HostBytes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _finish(ptr: int, leases: tuple[PinnedLease, ...], empty_torch_cache: bool,
            strict: bool) -> None:
    """Unregister ``ptr``, return torch's cached pinned blocks, release ``leases``."""
    try:
        if ptr:
            _unregister(ptr)
        if empty_torch_cache:
            _empty_torch_host_cache()
    except Exception:
        if strict:
            raise
    finally:
        for lease in leases:
            lease.release()


def allocate_host_bytes(budget: PinnedBudget, owner: str, nbytes: int,
                        pin: bool | None = None) -> HostBytes:
    """Reserve ``nbytes`` from ``budget`` for ``owner``, then allocate a page-aligned buffer.

    The reservation comes first: a refusal raises ``PinnedBudgetExceeded`` with nothing
    allocated. If the allocation itself fails the lease is released before the error propagates.
    """
    pinned = resolve_pin(pin)
    lease = budget.reserve(owner, nbytes)
    try:
        return _allocate(budget, lease, nbytes, pinned)
    except BaseException:
        lease.release()
        raise


def _allocate(budget: PinnedBudget, lease: PinnedLease, nbytes: int, pinned: bool) -> HostBytes:
    backing, view = aligned_empty(nbytes)
    if not pinned or nbytes == 0:
        return HostBytes(view, nbytes, (lease,), "pageable", backing)
    ptr = view.data_ptr()
    if _register(ptr, nbytes):
        return HostBytes(view, nbytes, (lease,), "registered", backing, registered_ptr=ptr)
    del backing, view
    _clear_cuda_error()
    total = _pow2_at_least(nbytes + HOST_ALIGN_BYTES)  # what torch's allocator really pins
    extra = budget.reserve(lease.owner, total - nbytes)
    try:
        backing = _torch_pinned(nbytes + HOST_ALIGN_BYTES)
    except BaseException:
        extra.release()
        raise
    offset = (-backing.data_ptr()) % HOST_ALIGN_BYTES
    return HostBytes(backing[offset:offset + nbytes], nbytes, (lease, extra), "torch_pinned",
                     backing)


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def aligned_empty(nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A pageable uint8 buffer of ``nbytes`` starting on a 4 KiB boundary: (backing, view)."""
    import torch

    backing = torch.empty(nbytes + HOST_ALIGN_BYTES, dtype=torch.uint8)
    offset = (-backing.data_ptr()) % HOST_ALIGN_BYTES
    return backing, backing[offset:offset + nbytes]


def _register(ptr: int, nbytes: int) -> bool:
    import torch

    try:
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)  # type: ignore[no-untyped-call]
    except (AttributeError, AssertionError, RuntimeError):
        return False
    return int(err) == 0


def _unregister(ptr: int) -> None:
    import torch

    err = int(torch.cuda.cudart().cudaHostUnregister(ptr))  # type: ignore[no-untyped-call]
    if err != 0:
        raise CapacityError(f"cudaHostUnregister failed with CUDA error {err}")


def _clear_cuda_error() -> None:
    """Consume the error a refused cudaHostRegister leaves as the runtime's last error, so the
    next unrelated CUDA call in torch does not report it. torch binds no cudaGetLastError, so
    call it on the runtime torch already loaded (never loading another copy)."""
    import ctypes

    import torch

    major = (torch.version.cuda or "").split(".")[0]
    for name in (f"libcudart.so.{major}", "libcudart.so"):
        try:
            runtime = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            runtime.cudaGetLastError()
        except (OSError, AttributeError):
            continue
        return


def _empty_torch_host_cache() -> None:
    import torch

    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
        empty = getattr(torch._C, name, None)
        if empty is not None:
            try:
                empty()
            except RuntimeError:  # no accelerator: nothing is cached
                pass
            return


def _torch_pinned(nbytes: int) -> torch.Tensor:
    import torch

    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as exc:
        raise CapacityError(f"could not pin {nbytes} host bytes: {exc}") from exc
