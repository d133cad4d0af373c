"""What a ``file://`` store handle offers its evictor: ``SegmentSite``, the ``evict.Site``
operations over the handle's own index, journal, descriptors and writer.

A view of one ``FileStore`` (it uses the store's index and its lock, the segment readers and
writer, record IO and ``publish``), held by the store's ``Evictor``, so that the evictor sees
these few operations and nothing else. Called on the thread that evicts (an IO worker whose
write needed room, or the thread that opened the store), beside the other IO workers.
"""

from __future__ import annotations

import logging
import os

from kvtier.store.file.handle import StoreHandle
from kvtier.store.file.index import split
from kvtier.store.file.journal import OP_EVICT, Entry
from kvtier.store.file.segment import segment_path
from kvtier.store.file.segment_files import owned_by_a_writer
from kvtier.store.record import Verdict

log = logging.getLogger(__name__)

#: Pages copied forward per write call.
REINSERT_BATCH = 16


class SegmentSite:
    """``evict.Site`` over one ``FileStore``."""

    def __init__(self, store: StoreHandle) -> None:
        self.store = store
        self.root = store.root
        self.counters = store.counters

    def capacity(self) -> tuple[int | None, int]:
        return self.store.options.max_bytes, self.store.options.min_free_bytes

    def used_bytes(self) -> int:
        return self.store.index.used_slots() * self.store.layout.record_bytes

    @property
    def record_bytes(self) -> int:
        return self.store.layout.record_bytes

    @property
    def reinsert_limit(self) -> int:
        return self.store.layout.slots // 2

    def catch_up(self) -> None:
        self.store.refresh()

    def oldest_segments(self) -> list[int]:
        with self.store.index_lock:
            return self.store.index.oldest_segments()

    def in_use(self, seg: int) -> bool:
        store = self.store
        return seg in store.writer.active_ids() or owned_by_a_writer(store.segments_dir, seg)

    def live_pages(self, seg: int) -> tuple[int, list[bytes]]:
        with self.store.index_lock:
            live = self.store.index.live_keys(seg)
            return len(live), [k for k in live if k in self.store.index.hot]

    def copy_forward(self, seg: int, keys: list[bytes]) -> int:
        fd = self.store.readers.pin(seg)
        if fd is None:
            return 0
        kept = 0
        try:
            for start in range(0, len(keys), REINSERT_BATCH):
                pages, good = [], []
                for key in keys[start:start + REINSERT_BATCH]:
                    with self.store.index_lock:
                        loc = self.store.index.where.get(key)
                    if loc is None or split(loc)[0] != seg:
                        continue  # overwritten or deleted meanwhile
                    page = memoryview(bytearray(self.store.page_bytes))
                    try:
                        if self.store.io.read(fd, split(loc)[1], key, page) is Verdict.OK:
                            pages.append(page)
                            good.append(key)
                    except OSError:
                        continue
                if good:
                    kept += sum(self.store.write_records(good, pages))
        finally:
            self.store.readers.unpin(seg)
        return kept

    def remove_segment(self, seg: int) -> bool:
        # Unlink first: on a full disk the journal append may fail, and the space must come
        # back anyway. A process that still maps keys to the file then reads misses.
        try:
            segment_path(self.store.segments_dir, seg).unlink(missing_ok=True)
        except OSError as exc:  # not a file we may remove: it stays, and so do its pages
            log.warning("file store %s: cannot evict segment %d: %s", self.root, seg, exc)
            self.counters.add(errors=1)
            return False
        try:
            self.store.publish([Entry(OP_EVICT, seg)])
        except OSError:
            self.counters.add(errors=1)
            with self.store.index_lock:
                self.store.index.drop_segment(seg)
        return True

    def segments_without_live_pages(self) -> list[int]:
        with self.store.index_lock:
            return self.store.index.segments_without_live_pages()

    def segment_mtime(self, seg: int) -> float | None:
        try:
            return os.stat(segment_path(self.store.segments_dir, seg)).st_mtime
        except FileNotFoundError:
            return None
