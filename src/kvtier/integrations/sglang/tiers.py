"""The stores behind kvtier's SGLang backend, nearest first (disk, then remote), as one chain.

Owns ``TierChain`` and ``open_tiers()``. Presence is answered by each store's ``contains`` (the
disk tier's in-memory index, one pipelined ``EXISTS`` round for Redis; never page data). A read
asks each tier in turn for the pages still missing; with ``promote`` a page found only further
away is copied into the nearer tiers from the buffer it was just read into. A write goes to every
tier that does not hold the page yet and succeeds when at least one tier holds it.

Stores never raise for a miss, a corrupt page or an outage; anything a store does raise is
logged and answered as a miss or a refused write here, so SGLang's prefetch and backup threads
keep running. Thread-safe (stores are; the chain holds no mutable state besides counters).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvtier.store import open_store
from kvtier.store.base import Buffer, PageStore, StoreCounters
from kvtier.units import redact_url

log = logging.getLogger(__name__)


class TierChain:
    """Ordered stores: ``read_into`` nearest first, ``write`` to all, ``contains`` = any."""

    def __init__(self, tiers: Sequence[tuple[str, PageStore]], *, promote: bool = True) -> None:
        if not tiers:
            raise ValueError("a tier chain needs at least one store")
        self.tiers = list(tiers)
        self.promote = promote
        self.counters = StoreCounters()

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        present = [False] * len(keys)
        for name, store in self.tiers:
            todo = [i for i, p in enumerate(present) if not p]
            if not todo:
                break
            found = self._call(name, "contains", store.contains, [keys[i] for i in todo])
            for i, hit in zip(todo, found or [False] * len(todo), strict=True):
                present[i] = hit
        return present

    def read_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        found = [False] * len(keys)
        for depth, (name, store) in enumerate(self.tiers):
            todo = [i for i, f in enumerate(found) if not f]
            if not todo:
                break
            got = self._call(name, "read", store.read_into, [keys[i] for i in todo],
                             [buffers[i] for i in todo]) or [False] * len(todo)
            hits = [i for i, ok in zip(todo, got, strict=True) if ok]
            for i in hits:
                found[i] = True
            if hits and depth and self.promote:
                self._promote(depth, [keys[i] for i in hits], [buffers[i] for i in hits])
        return found

    def write(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        held = [False] * len(keys)
        for name, store in self.tiers:
            present = self._call(name, "contains", store.contains, keys) or [False] * len(keys)
            todo = [i for i, p in enumerate(present) if not p]
            written = self._call(name, "write", store.write, [keys[i] for i in todo],
                                 [buffers[i] for i in todo]) if todo else []
            ok = set(i for i, w in zip(todo, written or [False] * len(todo), strict=True) if w)
            for i, p in enumerate(present):
                held[i] = held[i] or p or i in ok
        return held

    def _promote(self, depth: int, keys: list[bytes], buffers: list[Buffer]) -> None:
        for name, store in self.tiers[:depth]:
            self._call(name, "write", store.write, keys, buffers)

    def _call(self, tier: str, op: str, fn: Any, *args: Any) -> list[bool] | None:
        try:
            return fn(*args)
        except Exception:  # a store bug or misuse must not kill SGLang's storage threads
            self.counters.add(errors=1)
            log.exception("kvtier %s tier: %s of %d pages failed", tier, op, len(args[0]))
            return None

    def stats(self) -> dict[str, dict[str, Any]]:
        return {name: store.stats().as_dict() for name, store in self.tiers}

    def close(self) -> None:
        for name, store in self.tiers:
            try:
                store.close()
            except Exception:
                log.exception("kvtier %s tier: close failed", name)


def open_tiers(urls: dict[str, str], page_bytes: int, *, subdir: str | None,
               options: dict[str, dict[str, Any]], promote: bool) -> TierChain:
    """Open each tier's store; ``subdir`` is appended to ``file://`` paths (one page shape each)."""
    opened: list[tuple[str, PageStore]] = []
    try:
        for tier, url in urls.items():
            target = _with_subdir(url, subdir) if subdir else url
            store = open_store(target, page_bytes=page_bytes, **options.get(tier, {}))
            log.info("kvtier %s tier: %s (%d-byte pages)", tier, redact_url(target), page_bytes)
            opened.append((tier, store))
    except BaseException:
        for _, store in opened:
            store.close()
        raise
    return TierChain(opened, promote=promote)


def _with_subdir(url: str, subdir: str) -> str:
    parts = urlsplit(url)
    if parts.scheme != "file":
        return url
    return urlunsplit(parts._replace(path=os.path.join(parts.path, subdir)))
