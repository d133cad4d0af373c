"""The page store interface every tier below the host implements (memory, file, redis).

Owns ``PageStore`` (six abstract batch methods; partial reads and prefix probes derived once
here), ``StoreStats`` (the frozen snapshot every backend returns), ``StoreCounters`` (thread-safe
counters behind it) and ``writable_view`` (accepts numpy arrays, CPU torch uint8 tensors,
bytearrays and memoryviews as destination buffers). Stores are called from IO worker threads;
every method must be safe to call from several threads at once.

Contract:
- ``read_into`` and ``write`` never raise for a miss, a corrupt page, an outage or a full
  device: they return False for that page and count it. Misuse (a buffer of the wrong size,
  a read-only buffer, a closed store) raises.
- A page is visible to ``contains``/``read_into`` only once its ``write`` has completed.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable

from kvtier.errors import StoreClosed
from kvtier.layout import ByteRange

Buffer = Any  # numpy array, torch CPU tensor, bytearray or memoryview


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of one store's state and lifetime counters."""

    backend: str
    pages: int = 0
    bytes: int = 0
    capacity_bytes: int | None = None
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    refused: int = 0
    evicted: int = 0
    dropped: int = 0   # pages removed because they failed verification (stored again later)
    errors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    #: Records re-indexed from the segments after a lost index (``file://``), and those of
    #: them skipped (torn, corrupt, another format): never served.
    recovered: int = 0
    recovery_skipped: int = 0

    def as_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Probe:
    """What a store's health check found (``PageStore.probe``).

    ``problem``: empty when healthy, else one sentence that says what is wrong and what to do;
    ``reason``: its class (``unreachable``, ``gone``, ``io_errors``), a metric label;
    ``lost``: the pages the store held may be gone (a server restarted empty, a flush), so
    what an index believes the store holds is stale; ``reopen``: this handle can no longer
    serve (its directory was removed or replaced) and the store must be opened again;
    ``detail``: what bounds the store's writes now (free space, cap), said when they fail."""

    problem: str = ""
    reason: str = ""
    lost: bool = False
    reopen: bool = False
    detail: str = ""


class StoreCounters:
    """Lifetime counters of a store, safe to bump from several threads."""

    NAMES = ("hits", "misses", "corrupt", "refused", "evicted", "dropped", "errors",
             "bytes_read", "bytes_written", "recovered", "recovery_skipped")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.NAMES, 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


def writable_view(buffer: Buffer, nbytes: int) -> memoryview:
    """A flat writable byte view of ``buffer``; raises ValueError unless it has ``nbytes`` bytes."""
    if hasattr(buffer, "is_cuda") and hasattr(buffer, "numpy"):  # torch tensor
        if buffer.is_cuda:
            raise ValueError("stores read into host memory; got a CUDA tensor")
        if not buffer.is_contiguous():
            raise ValueError("destination tensor must be contiguous")
        buffer = buffer.view(-1).numpy().view("uint8") if buffer.numel() else buffer.numpy()
    view = memoryview(buffer)
    if view.readonly:
        raise ValueError("destination buffer is read-only")
    if not view.c_contiguous:
        raise ValueError("destination buffer must be contiguous")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if view.nbytes != nbytes:
        raise ValueError(f"destination buffer has {view.nbytes} bytes, a page has {nbytes}")
    return view


def readable_view(buffer: Buffer, nbytes: int) -> memoryview:
    """A flat byte view of a source buffer; raises ValueError unless it has ``nbytes`` bytes."""
    if hasattr(buffer, "is_cuda") and hasattr(buffer, "numpy"):
        if buffer.is_cuda:
            raise ValueError("stores write from host memory; got a CUDA tensor")
        buffer = buffer.contiguous().view(-1).numpy().view("uint8")
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError("source buffer must be contiguous")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if view.nbytes != nbytes:
        raise ValueError(f"source buffer has {view.nbytes} bytes, a page has {nbytes}")
    return view


@runtime_checkable
class Resizable(Protocol):
    """A store whose kvtier-side cap can change while it runs (``file://``, ``memory://``; a
    Redis server's cap is its own ``maxmemory``). Returns what the resize did."""

    def resize(self, max_bytes: int | None) -> dict[str, object]: ...


class PageStore(ABC):
    """A batch-first store of fixed-size pages named by ``PageKey``."""

    #: URL scheme this backend serves (``file``, ``memory``, ``redis``).
    scheme: str = ""

    def __init__(self, page_bytes: int) -> None:
        if page_bytes < 1:
            raise ValueError(f"page_bytes must be >= 1, got {page_bytes}")
        self.page_bytes = page_bytes
        self._closed = False

    # ---- the contract ------------------------------------------------------------------
    @abstractmethod
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys are readable now (answered without reading page data where possible)."""

    @abstractmethod
    def read_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        """Fill ``buffers[i]`` with page ``keys[i]``; False = miss, corrupt or unavailable."""

    @abstractmethod
    def write(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        """Store pages; True once durable-and-visible, False = refused (counted)."""

    @abstractmethod
    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove pages; returns how many existed."""

    @abstractmethod
    def stats(self) -> StoreStats:
        """A frozen snapshot of contents and counters."""

    @abstractmethod
    def close(self) -> None:
        """Release files, connections and threads. Idempotent."""

    # ---- health (overridden by backends that can tell more) ----------------------------
    def probe(self) -> Probe:
        """A cheap health check, run off the IO path (a store guard's thread) every few
        seconds; never raises for an outage (it says so instead)."""
        return Probe()

    @property
    def available(self) -> bool:
        """False while nothing serves behind this store (a guard whose store is off): callers
        may skip work for it. Every call still answers (misses, refused writes)."""
        return True

    @property
    def epoch(self) -> int:
        """Grows each time the pages this store held may have been lost (a reopen, a server
        restarted empty): what an index believed it holds before is stale."""
        return 0

    def health(self) -> dict[str, object] | None:
        """State of a supervised store (``state``, ``problems``, retry times), any thread;
        None for a store nobody supervises."""
        return None

    # ---- derived -----------------------------------------------------------------------
    def read_ranges_into(self, keys: Sequence[bytes], ranges: Sequence[ByteRange],
                         buffers: Sequence[Buffer]) -> list[bool]:
        """Read only ``ranges`` of each page (a TP rank's heads, a PP stage's layers), packed
        back to back into ``buffers[i]`` (``sum(r.length for r in ranges)`` bytes each).

        The generic path reads whole pages into a scratch buffer and copies the ranges out;
        backends that can read ranges directly (pread) override it.
        """
        want = sum(r.length for r in ranges)
        views = [writable_view(b, want) for b in buffers]
        scratch = [bytearray(self.page_bytes) for _ in keys]
        found = self.read_into(keys, scratch)
        for ok, page, view in zip(found, scratch, views, strict=True):
            if ok:
                pos = 0
                for r in ranges:
                    view[pos:pos + r.length] = page[r.offset:r.end]
                    pos += r.length
        return found

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are present (a stored prefix is contiguous from the root)."""
        for i, present in enumerate(self.contains(keys)):
            if not present:
                return i
        return len(keys)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"{self.scheme} store is closed")

    def _check_batch(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> None:
        self._check_open()
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")

    def __enter__(self) -> PageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
