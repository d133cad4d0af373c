"""Fixed-slot page allocator shared by the device pool and the host pool.

Owns ``PageAllocator``: page ids ``0 .. num_pages-1`` handed out all-or-nothing. Every page is
the same size, so the pool cannot fragment: any free id serves any request. Freed ids are reused
first (warm memory). Misuse (freeing an id twice or one outside the pool) raises ``ValueError``
and changes nothing. Pure Python over ints, no torch.

Thread-safe (one short lock per call): the engine thread allocates and frees; nothing waits.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from kvtier.errors import PoolExhausted


class PageAllocator:
    """Hands out page ids of a pool of ``num_pages`` equal pages; ``allocate`` is all-or-nothing."""

    def __init__(self, num_pages: int, name: str = "pool") -> None:
        if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 0:
            raise ValueError(f"a page pool needs an integer number of pages >= 0, got {num_pages!r}")
        self.name = name
        self._num_pages = num_pages
        self._lock = threading.Lock()
        # Stack of free ids: popping from the end hands out 0, 1, 2, ... first, and a freed id
        # is the next one reused.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._used = bytearray(num_pages)
        self._allocated_total = 0
        self._freed_total = 0
        self._refused_total = 0

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._num_pages - len(self._free)

    def can_allocate(self, n: int) -> bool:
        """Whether ``allocate(n)`` would succeed now."""
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` free page ids, or ``PoolExhausted`` with nothing allocated."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"cannot allocate {n!r} pages")
        with self._lock:
            if n > len(self._free):
                self._refused_total += 1
                raise PoolExhausted(
                    f"{self.name}: asked for {n} pages, {len(self._free)} of "
                    f"{self._num_pages} free"
                )
            if n == 0:
                return []
            ids = self._free[-n:]
            del self._free[-n:]
            ids.reverse()
            for page in ids:
                self._used[page] = 1
            self._allocated_total += n
            return ids

    def free(self, ids: Iterable[int]) -> None:
        """Return pages to the pool. All ids are checked first: a bad one frees nothing."""
        ids = list(ids)
        with self._lock:
            self._check_freeable(ids)
            for page in ids:
                self._used[page] = 0
            self._free.extend(reversed(ids))
            self._freed_total += len(ids)

    def _check_freeable(self, ids: list[int]) -> None:
        seen: set[int] = set()
        for page in ids:
            if not isinstance(page, int) or not 0 <= page < self._num_pages:
                raise ValueError(f"{self.name}: page id {page!r} is outside [0, {self._num_pages})")
            if not self._used[page] or page in seen:
                raise ValueError(f"{self.name}: page {page} is not allocated (double free?)")
            seen.add(page)

    def is_allocated(self, page: int) -> bool:
        return 0 <= page < self._num_pages and bool(self._used[page])

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless free + used == total with no id both or neither."""
        with self._lock:
            free_set = set(self._free)
            used = sum(self._used)
            assert len(free_set) == len(self._free), f"{self.name}: a page is free twice"
            assert len(self._free) + used == self._num_pages, (
                f"{self.name}: {len(self._free)} free + {used} used != {self._num_pages} total")
            for page in free_set:
                assert 0 <= page < self._num_pages and not self._used[page], (
                    f"{self.name}: page {page} is both free and used")

    def stats(self) -> dict[str, object]:
        with self._lock:
            return {"num_pages": self._num_pages, "free": len(self._free),
                    "used": self._num_pages - len(self._free),
                    "allocated_total": self._allocated_total, "freed_total": self._freed_total,
                    "refused_total": self._refused_total}
