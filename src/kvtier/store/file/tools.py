"""Maintenance views of a ``file://`` store: listing, full verification, payload locations.

Owns the functions behind ``kvtier store ls|verify`` and the raw-disk benchmark baseline: they
look at a ``FileStore``'s index and records without going through the page-store contract
(verification needs the reason a record fails, the baseline needs where its bytes sit). Run on
the main thread of a maintenance command; safe beside IO workers of the same handle.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from kvtier.store.file.index import split
from kvtier.store.file.record_io import RecordIO
from kvtier.store.file.segment import segment_path
from kvtier.store.file.store import FileStore

VERDICTS = ("ok", "torn", "foreign", "corrupt", "io_error", "gone")


def iter_pages(store: FileStore) -> Iterator[tuple[bytes, int, int]]:
    """(key, segment, slot) of every live page, oldest segment first."""
    store.refresh()
    with store._lock:
        items = [(key, *split(loc)) for key, loc in store.index.where.items()]
    items.sort(key=lambda item: (item[1], item[2]))
    yield from items


def payload_locations(store: FileStore, keys: Sequence[bytes]) -> list[tuple[Path, int] | None]:
    """(segment file, byte offset of the payload) of each key's record; None where absent."""
    store.refresh()
    out: list[tuple[Path, int] | None] = []
    with store._lock:
        for key in keys:
            loc = store.index.where.get(key)
            if loc is None:
                out.append(None)
                continue
            seg, slot = split(loc)
            out.append((segment_path(store.segments_dir, seg), store.layout.payload_at(slot)))
    return out


def verify_all(store: FileStore, progress: Callable[[int], None] = lambda n: None) -> Counter[str]:
    """Read and fully check every live record (payload checksum included, whatever the
    store's ``verify`` option); counts by verdict (``VERDICTS``)."""
    counts: Counter[str] = Counter()
    page = memoryview(bytearray(store.page_bytes))
    io = RecordIO(store.layout, direct=store.options.direct, verify_payload=True)
    for key, seg, slot in iter_pages(store):
        fd = store.readers.pin(seg)
        if fd is None:
            counts["gone"] += 1  # evicted since the listing
        else:
            try:
                counts[io.read(fd, slot, key, page).value] += 1
            except OSError:
                counts["io_error"] += 1
            finally:
                store.readers.unpin(seg)
        progress(1)
    return counts
