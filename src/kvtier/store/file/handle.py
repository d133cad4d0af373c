"""What the modules working on a ``file://`` store see of it: the ``StoreHandle`` protocol.

Owns ``StoreHandle``: what the evictor's ``site.SegmentSite``, ``damage.DamagedPages`` and the
``health`` probe use of one ``FileStore`` (the directory and its options and layout, the shared
index and its lock, the segment readers and writer, record IO, the counters, and ``publish``,
``refresh`` and ``write_records``). Those modules are typed against this protocol and ``store``
hands them ``self``, so ``store`` imports them and none of them imports ``store``. Types only:
nothing here runs on any thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from kvtier.store.base import StoreCounters
from kvtier.store.file.evict import Evictor
from kvtier.store.file.index import PageIndex
from kvtier.store.file.journal import Entry
from kvtier.store.file.options import FileStoreOptions
from kvtier.store.file.record_io import RecordIO
from kvtier.store.file.segment import RecordLayout
from kvtier.store.file.segment_files import SegmentReaders, SegmentWriter


class StoreHandle(Protocol):
    """One open ``FileStore`` as those modules see it (``FileStore`` is the implementation)."""

    root: Path
    segments_dir: Path
    page_bytes: int
    options: FileStoreOptions
    layout: RecordLayout
    manifest_id: tuple[int, int]
    counters: StoreCounters
    readers: SegmentReaders
    writer: SegmentWriter
    io: RecordIO
    index: PageIndex
    evictor: Evictor

    @property
    def index_lock(self) -> threading.Lock:
        """The lock that guards the index and the journal handle."""
        ...

    def refresh(self) -> None:
        """Apply what other processes appended to the journal since the last call."""
        ...

    def publish(self, entries: list[Entry] | Callable[[], list[Entry]]) -> None:
        """Append ``entries`` to the journal and apply them; raises OSError if nothing was."""
        ...

    def write_records(self, keys: list[bytes], views: list[memoryview]) -> list[bool]:
        """Write pages as records of this handle's segments (what ``write`` does per batch)."""
        ...
