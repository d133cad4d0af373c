"""Moving a damaged store directory aside, never deleting it: ``<dir>.corrupt-<UTC time>``.

Owns ``identity`` (what names one directory: its path, device and inode, as ``StoreCorrupt``
carries it) and ``set_aside``, which renames the directory found damaged to a free
``<dir>.corrupt-YYYYmmddTHHMMSSZ`` name so that a fresh store can be created in its place, while
the damaged bytes stay for an operator to inspect. Several processes may find the same damage at
once: the rename happens under an exclusive ``flock`` of the damaged directory and only while
the path still names the very directory that was found damaged, so a second process never moves
aside the fresh store the first one just created. Runs on the thread that opens a store.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

SUFFIX = ".corrupt-"


def identity(path: str | Path) -> tuple[str, int, int] | None:
    """``(path, st_dev, st_ino)`` of the directory ``path`` names now (None: not there)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return str(path), st.st_dev, st.st_ino


def set_aside(location: tuple[str, int, int], *, now: float | None = None) -> Path | None:
    """Rename the directory ``location`` describes to ``<dir>.corrupt-<UTC>``; returns the new
    path, or None when the path no longer names that directory (moved aside by another process,
    or replaced). Raises OSError when the rename itself fails (no permission on the parent)."""
    path, dev, ino = location
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        held, current = os.fstat(fd), identity(path)
        if (held.st_dev, held.st_ino) != (dev, ino) or current != location:
            return None
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
        target = Path(f"{path}{SUFFIX}{stamp}")
        n = 0
        while target.exists():
            n += 1
            target = Path(f"{path}{SUFFIX}{stamp}-{n}")
        os.rename(path, target)
        return target
    finally:
        os.close(fd)
