"""``memory://``: the reference page store, held in this process's RAM.

Owns ``MemoryStore``: a dict of page copies with an optional byte cap (LRU eviction past it).
It is a real backend (tests and single-process deployments use it), and the model the other
backends are checked against. ``memory://NAME`` opens a process-wide named instance, so a
"reopen" sees the same pages; a bare ``memory://`` is private. Thread-safe (one lock).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import ClassVar
from urllib.parse import urlsplit

from kvtier.errors import ConfigError
from kvtier.store.base import Buffer, PageStore, StoreCounters, StoreStats, readable_view, writable_view
from kvtier.units import parse_size


class _Shelf:
    """The pages and counters of one memory store, shared by every handle opened on one name."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pages: OrderedDict[bytes, bytes] = OrderedDict()
        self.counters = StoreCounters()


class MemoryStore(PageStore):
    scheme = "memory"
    _named: ClassVar[dict[tuple[str, int], _Shelf]] = {}
    _named_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, page_bytes: int, *, max_bytes: int | None = None, name: str = "") -> None:
        super().__init__(page_bytes)
        if max_bytes is not None and max_bytes < page_bytes:
            raise ConfigError("max_bytes", max_bytes, f"at least one page ({page_bytes} bytes)")
        self.max_pages = None if max_bytes is None else max_bytes // page_bytes
        self.name = name
        if name:
            with self._named_lock:
                self._shelf = self._named.setdefault((name, page_bytes), _Shelf())
        else:
            self._shelf = _Shelf()

    @classmethod
    def from_url(cls, url: str, page_bytes: int, options: dict[str, object]) -> MemoryStore:
        parts = urlsplit(url)
        max_bytes = options.pop("max_bytes", None)
        if isinstance(max_bytes, str):
            parsed = parse_size(max_bytes)
            if parsed is None:
                raise ConfigError("max_bytes", max_bytes, "a byte count such as 1GiB")
            max_bytes = parsed
        if max_bytes is not None and not isinstance(max_bytes, int):
            raise ConfigError("max_bytes", max_bytes, "a byte count such as 1GiB")
        if options:
            raise ConfigError("memory store options", sorted(options), "max_bytes")
        return cls(page_bytes, max_bytes=max_bytes, name=(parts.netloc + parts.path).strip("/"))

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self._check_open()
        pages = self._shelf.pages
        with self._shelf.lock:
            return [bytes(k) in pages for k in keys]

    def read_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        self._check_batch(keys, buffers)
        views = [writable_view(b, self.page_bytes) for b in buffers]
        found: list[bool] = []
        shelf = self._shelf
        with shelf.lock:
            for key, view in zip(keys, views, strict=True):
                page = shelf.pages.get(bytes(key))
                if page is not None:
                    shelf.pages.move_to_end(bytes(key))
                    view[:] = page
                found.append(page is not None)
        hits = sum(found)
        shelf.counters.add(hits=hits, misses=len(found) - hits, bytes_read=hits * self.page_bytes)
        return found

    def write(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        self._check_batch(keys, buffers)
        copies = [bytes(readable_view(b, self.page_bytes)) for b in buffers]
        shelf = self._shelf
        evicted = 0
        with shelf.lock:
            for key, data in zip(keys, copies, strict=True):
                shelf.pages[bytes(key)] = data
                shelf.pages.move_to_end(bytes(key))
                while self.max_pages is not None and len(shelf.pages) > self.max_pages:
                    shelf.pages.popitem(last=False)
                    evicted += 1
        shelf.counters.add(evicted=evicted, bytes_written=len(copies) * self.page_bytes)
        return [True] * len(copies)

    def delete(self, keys: Sequence[bytes]) -> int:
        self._check_open()
        with self._shelf.lock:
            return sum(self._shelf.pages.pop(bytes(k), None) is not None for k in keys)

    def resize(self, max_bytes: int | None) -> dict[str, object]:
        """Set the byte cap now; a shrink evicts least recently used pages until the store fits
        (under the store's lock, so no read or write is ever cut short)."""
        if max_bytes is not None and max_bytes < self.page_bytes:
            raise ConfigError("max_bytes", max_bytes, f"at least one page ({self.page_bytes} bytes)")
        shelf = self._shelf
        evicted = 0
        with shelf.lock:
            self.max_pages = None if max_bytes is None else max_bytes // self.page_bytes
            while self.max_pages is not None and len(shelf.pages) > self.max_pages:
                shelf.pages.popitem(last=False)
                evicted += 1
        shelf.counters.add(evicted=evicted)
        return {"fits": True}

    def clear(self) -> None:
        with self._shelf.lock:
            self._shelf.pages.clear()

    def stats(self) -> StoreStats:
        with self._shelf.lock:
            pages = len(self._shelf.pages)
        cap = None if self.max_pages is None else self.max_pages * self.page_bytes
        return StoreStats(backend=self.scheme, pages=pages, bytes=pages * self.page_bytes,
                          capacity_bytes=cap, **self._shelf.counters.snapshot())

    def close(self) -> None:
        self._closed = True
