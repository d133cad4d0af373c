"""The read ring: a fixed set of pinned page buffers that storage reads land in.

Owns ``ReadRing`` and ``RingBuffer``. The ring allocates its slots once, as one buffer whose bytes
are reserved from the ``PinnedBudget``; each slot starts on a 4 KiB boundary. Every storage read
path (whole pages and partial slices) borrows a slot, reads into it, and gives it back, so no
pinned memory is allocated per page on the hot path (that is slow and takes the driver lock).

When every slot is out, a borrow does not wait: it gets a fresh pageable buffer, counted in
``overflow_total`` — a bounded spike of memory is better than a stalled prefetch worker. A
borrow used as a context manager returns its buffer however the block exits, including when the
read raises.

Thread-safe: IO worker threads borrow and return concurrently under one short lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from kvtier.errors import StoreClosed
from kvtier.memory.host_bytes import HOST_ALIGN_BYTES, HostBytes, aligned_empty, allocate_host_bytes
from kvtier.memory.pinned import PinnedBudget

if TYPE_CHECKING:
    import torch


class RingBuffer:
    """One borrowed buffer: a ring slot (``slot`` is its index) or an overflow buffer (``None``)."""

    __slots__ = ("_ring", "slot", "tensor")

    def __init__(self, ring: ReadRing, slot: int | None, tensor: torch.Tensor) -> None:
        self._ring: ReadRing | None = ring
        self.slot = slot
        self.tensor: torch.Tensor | None = tensor  # None once released

    @property
    def overflow(self) -> bool:
        return self.slot is None

    @property
    def released(self) -> bool:
        return self._ring is None

    def release(self) -> None:
        """Give the buffer back (idempotent). Do not use ``tensor`` afterwards."""
        ring, self._ring = self._ring, None
        if ring is not None:
            ring._give_back(self)
        self.tensor = None


def _held(buf: RingBuffer) -> torch.Tensor:
    assert buf.tensor is not None, "a ring buffer used after its release"
    return buf.tensor


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class ReadRing:
    """``slots`` pinned buffers of ``page_bytes`` each (the slot size: add room for a record
    header if reads land with it), borrowed by storage reads."""

    def __init__(self, slots: int, page_bytes: int, budget: PinnedBudget, pin: bool | None = None,
                 owner: str = "read_ring") -> None:
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 0:
            raise ValueError(f"a read ring needs an integer number of slots >= 0, got {slots!r}")
        if not isinstance(page_bytes, int) or page_bytes < 1:
            raise ValueError(f"a read ring needs page_bytes >= 1, got {page_bytes!r}")
        self.slots = slots
        self.page_bytes = page_bytes
        self.slot_stride = _round_up(page_bytes, HOST_ALIGN_BYTES)
        self._host: HostBytes | None = allocate_host_bytes(budget, owner, slots * self.slot_stride,
                                                           pin)
        self._free: list[int] = list(range(slots - 1, -1, -1))
        base = self._host.tensor
        assert base is not None, "freshly allocated bytes are open"
        self._views = [base[i * self.slot_stride:i * self.slot_stride + page_bytes]
                       for i in range(slots)]
        self._lock = threading.Lock()
        self._borrowed_total = 0
        self._overflow_total = 0
        self._overflow_bytes_total = 0
        self._overflow_in_use = 0
        self._peak_in_use = 0

    @property
    def nbytes(self) -> int:
        """Bytes the ring holds (and has reserved from the budget)."""
        return self.slots * self.slot_stride

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def pinned(self) -> bool:
        return self._host is not None and self._host.pinned

    # ---- borrowing ---------------------------------------------------------------------------
    def acquire(self, nbytes: int | None = None) -> RingBuffer:
        """A buffer of ``nbytes`` (default ``page_bytes``): a free slot, else a counted overflow
        buffer. Never blocks. The caller must ``release()`` it (``borrow`` does so for you)."""
        size = self._size(nbytes)
        with self._lock:
            if self._host is None:
                raise StoreClosed("the read ring is closed")
            self._borrowed_total += 1
            if self._free:
                slot = self._free.pop()
                self._note_in_use()
                view = self._views[slot]
                return RingBuffer(self, slot, view if size == self.page_bytes else view[:size])
            self._overflow_total += 1
            self._overflow_bytes_total += size
            self._overflow_in_use += 1
            self._note_in_use()
        _, view = aligned_empty(size)
        return RingBuffer(self, None, view)

    def acquire_many(self, count: int, nbytes: int | None = None) -> list[RingBuffer]:
        """``count`` buffers (slots first, overflow for the rest); all-or-nothing on error."""
        taken: list[RingBuffer] = []
        try:
            for _ in range(count):
                taken.append(self.acquire(nbytes))
        except BaseException:
            for buf in taken:
                buf.release()
            raise
        return taken

    @contextmanager
    def borrow(self, nbytes: int | None = None) -> Iterator[torch.Tensor]:
        """``with ring.borrow() as buf:`` a uint8 tensor, returned when the block exits."""
        held = self.acquire(nbytes)
        try:
            yield _held(held)
        finally:
            held.release()

    @contextmanager
    def borrow_many(self, count: int, nbytes: int | None = None) -> Iterator[list[torch.Tensor]]:
        """``with ring.borrow_many(n) as bufs:`` ``n`` uint8 tensors for one batched read."""
        held = self.acquire_many(count, nbytes)
        try:
            yield [_held(h) for h in held]
        finally:
            for h in held:
                h.release()

    def _size(self, nbytes: int | None) -> int:
        size = self.page_bytes if nbytes is None else nbytes
        if not isinstance(size, int) or not 0 < size <= self.page_bytes:
            raise ValueError(f"a ring buffer holds 1..{self.page_bytes} bytes, asked {size!r}")
        return size

    def _note_in_use(self) -> None:
        in_use = self.slots - len(self._free) + self._overflow_in_use
        self._peak_in_use = max(self._peak_in_use, in_use)

    def _give_back(self, buf: RingBuffer) -> None:
        with self._lock:
            if buf.slot is None:
                self._overflow_in_use -= 1
            elif self._host is not None:
                self._free.append(buf.slot)

    # ---- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Free the slots and return their bytes to the budget; idempotent. Buffers still out
        stay valid memory (no longer pinned) until their holders drop them."""
        with self._lock:
            host, self._host = self._host, None
            self._free = []
            self._views = []
        if host is not None:
            host.close()

    def __enter__(self) -> ReadRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, object]:
        with self._lock:
            slots_out = 0 if self._host is None else self.slots - len(self._free)
            return {"slots": self.slots, "slot_bytes": self.page_bytes,
                    "bytes": self.nbytes, "free_slots": len(self._free),
                    "slots_in_use": slots_out, "overflow_in_use": self._overflow_in_use,
                    "peak_in_use": self._peak_in_use, "borrowed_total": self._borrowed_total,
                    "overflow_total": self._overflow_total,
                    "overflow_bytes_total": self._overflow_bytes_total,
                    "closed": self._host is None}
