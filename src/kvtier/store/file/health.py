"""The ``file://`` store's health check: is the directory still the one opened, what bounds writes.

Owns ``manifest_identity`` (device and inode of the store's manifest, noted at open) and
``probe_file_store``, which a store guard's thread runs every few seconds: a directory removed
or replaced under a running store is otherwise invisible, because the store keeps writing into
and reading from the files it holds open (the unlinked segments and journal), so every call
still succeeds. The probe also says what bounds the store's writes now (free space against the
``min_free_bytes`` floor, segment bytes against the ``max_bytes`` cap), for the warning a guard
logs when writes are refused. One ``stat`` and one ``statvfs``; no locks taken.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.store.base import Probe
from kvtier.store.file.handle import StoreHandle
from kvtier.store.file.segment import MANIFEST
from kvtier.units import format_size


def manifest_identity(root: Path) -> tuple[int, int]:
    """``(st_dev, st_ino)`` of ``root``'s manifest; raises OSError (FileNotFoundError: gone)."""
    st = os.stat(root / MANIFEST)
    return st.st_dev, st.st_ino


def probe_file_store(store: StoreHandle) -> Probe:
    root = store.root
    detail = capacity_detail(store)
    try:
        now = manifest_identity(root)
    except FileNotFoundError:
        return Probe(f"the store directory {root} (or its {MANIFEST}) was removed while the "
                     "store ran: the pages it held are gone", "gone", lost=True, reopen=True,
                     detail=detail)
    except OSError as exc:
        return Probe(f"cannot check the store directory {root}: {exc.strerror or exc}",
                     "io_errors", detail=detail)
    if now != store.manifest_id:
        return Probe(f"the store directory {root} was replaced while the store ran: the pages "
                     "it held are gone", "gone", lost=True, reopen=True, detail=detail)
    return Probe(detail=detail)


def capacity_detail(store: StoreHandle) -> str:
    """What bounds writes: free space and its floor, segment bytes and their cap."""
    options, record = store.options, store.layout.record_bytes
    parts = []
    try:
        fs = os.statvfs(store.root)
        free = human(fs.f_bavail * fs.f_frsize)
    except OSError as exc:
        free = f"unknown ({exc.strerror or exc})"
    floor = options.min_free_bytes
    parts.append(f"free space {free}" + (f", floor min_free_bytes {format_size(floor)}"
                                         if floor else ""))
    if options.max_bytes is not None:
        used = store.index.used_slots() * record
        parts.append(f"segments {human(used)} of the cap max_bytes "
                     f"{format_size(options.max_bytes)}")
    parts.append(f"a page takes {human(record)}, a segment "
                 f"{human(store.layout.segment_bytes)}")
    return "; ".join(parts)


def human(count: int) -> str:
    """1288490188 -> '1.2 GiB' (measured sizes, which are rarely whole units)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"
