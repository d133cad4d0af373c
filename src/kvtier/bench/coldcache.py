"""Make the disk tier cold for a benchmark: evict its files from the OS page cache.

Owns ``drop_page_cache(url)``: it flushes each file under the store's directory and asks the
kernel to forget its cached pages (``posix_fadvise(DONTNEED)``, unprivileged, only our files).
On a machine of its own a benchmark may instead drop the whole page cache (root, writing 1 to
``/proc/sys/vm/drop_caches``). Returns which method took effect. Main thread.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit


def _store_dir(url: str) -> Path | None:
    parts = urlsplit(url)
    if parts.scheme != "file":
        return None
    return Path(parts.netloc + parts.path)


def _fadvise_tree(root: Path) -> int:
    dropped = 0
    for path in root.rglob("*"):
        if not path.is_file():
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            dropped += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return dropped


def drop_page_cache(url: str, *, whole_machine: bool = False) -> str:
    """Evict a file store's pages from the page cache: 'fadvise' (its own files, flushed first),
    'drop_caches' (``whole_machine``, as root: every cached file of the machine, which slows
    everything else running there), or 'none' (not a file store, or nothing was dropped)."""
    root = _store_dir(url)
    if root is None or not root.exists():
        return "none"
    if whole_machine:
        os.sync()
        try:
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
            return "drop_caches"
        except OSError:
            pass
    return "fadvise" if _fadvise_tree(root) else "none"
