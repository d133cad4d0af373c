"""What a ``file://`` store handle offers its evictor: ``SegmentSite``, the ``evict.Site``
operations over the handle's own index, journal, descriptors and writer.

A mixin of ``FileStore`` (it uses the store's index and its lock, the segment readers and
writer, record IO and ``publish``), kept apart so that the evictor sees these few operations
and nothing else. Called on the thread that evicts (an IO worker whose write needed room, or
the thread that opened the store), beside the other IO workers.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from kvtier.store.file.index import split
from kvtier.store.file.journal import OP_EVICT, Entry
from kvtier.store.file.segment import segment_path
from kvtier.store.file.segment_files import owned_by_a_writer
from kvtier.store.record import Verdict

if TYPE_CHECKING:
    from kvtier.store.file.store import FileStore

log = logging.getLogger(__name__)

#: Pages copied forward per write call.
REINSERT_BATCH = 16


class SegmentSite:
    """``evict.Site`` for ``FileStore`` (mixed into it)."""

    def capacity(self: FileStore) -> tuple[int | None, int]:
        return self.options.max_bytes, self.options.min_free_bytes

    def used_bytes(self: FileStore) -> int:
        return self.index.used_slots() * self.layout.record_bytes

    @property
    def record_bytes(self: FileStore) -> int:
        return self.layout.record_bytes

    @property
    def reinsert_limit(self: FileStore) -> int:
        return self.layout.slots // 2

    def catch_up(self: FileStore) -> None:
        self.refresh()

    def oldest_segments(self: FileStore) -> list[int]:
        with self._lock:
            return self.index.oldest_segments()

    def in_use(self: FileStore, seg: int) -> bool:
        return seg in self.writer.active_ids() or owned_by_a_writer(self.segments_dir, seg)

    def live_pages(self: FileStore, seg: int) -> tuple[int, list[bytes]]:
        with self._lock:
            live = self.index.live_keys(seg)
            return len(live), [k for k in live if k in self.index.hot]

    def copy_forward(self: FileStore, seg: int, keys: list[bytes]) -> int:
        fd = self.readers.pin(seg)
        if fd is None:
            return 0
        kept = 0
        try:
            for start in range(0, len(keys), REINSERT_BATCH):
                pages, good = [], []
                for key in keys[start:start + REINSERT_BATCH]:
                    with self._lock:
                        loc = self.index.where.get(key)
                    if loc is None or split(loc)[0] != seg:
                        continue  # overwritten or deleted meanwhile
                    page = memoryview(bytearray(self.page_bytes))
                    try:
                        if self.io.read(fd, split(loc)[1], key, page) is Verdict.OK:
                            pages.append(page)
                            good.append(key)
                    except OSError:
                        continue
                if good:
                    kept += sum(self.write_records(good, pages))
        finally:
            self.readers.unpin(seg)
        return kept

    def remove_segment(self: FileStore, seg: int) -> bool:
        # Unlink first: on a full disk the journal append may fail, and the space must come
        # back anyway. A process that still maps keys to the file then reads misses.
        try:
            segment_path(self.segments_dir, seg).unlink(missing_ok=True)
        except OSError as exc:  # not a file we may remove: it stays, and so do its pages
            log.warning("file store %s: cannot evict segment %d: %s", self.root, seg, exc)
            self.counters.add(errors=1)
            return False
        try:
            self.publish([Entry(OP_EVICT, seg)])
        except OSError:
            self.counters.add(errors=1)
            with self._lock:
                self.index.drop_segment(seg)
        return True

    def segments_without_live_pages(self: FileStore) -> list[int]:
        with self._lock:
            return self.index.segments_without_live_pages()

    def segment_mtime(self: FileStore, seg: int) -> float | None:
        try:
            return os.stat(segment_path(self.segments_dir, seg)).st_mtime
        except FileNotFoundError:
            return None
