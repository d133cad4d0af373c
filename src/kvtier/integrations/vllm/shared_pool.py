"""kvtier's staging pool in shared memory, for vLLM workers that run in processes of their own.

Owns ``SharedPool``: one file under ``/dev/shm`` holding the ``DevicePool`` tensor of the
engine-core process's ``TieredCache`` (``[layers, K|V, pages, page_size, kv_heads, head_dim]``,
every KV head of the model), and ``PoolRef``, the picklable name a step's metadata carries so
that each worker maps the same bytes (``attach``). The scheduler stages verified hits into it
and the workers copy their head slice out of it; the workers fill their head slice of a save
into it and the scheduler commits it (``rank_worker``).

The file is reserved in full at creation (``posix_fallocate``): a ``/dev/shm`` too small for it
is refused at start naming the setting, never met later as a bus error in the middle of a copy.
Its name carries the creator's pid; files of creators that died without unlinking theirs (a
killed engine) are removed when the next pool is created. Bookkeeping runs on whichever thread
builds the runtime or the worker half; the bytes are read and written by the copies the
scheduler and the workers order by their steps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtier.errors import ConfigError

log = logging.getLogger(__name__)

#: Where the pools live: tmpfs on Linux (vLLM's own multi-process queues use it too).
SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^kvtier-vllm-(\d+)-[0-9A-Za-z_.-]+\.pool$")


@dataclass(frozen=True)
class PoolRef:
    """What a worker needs to map the pool: its file, shape and dtype name."""

    path: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


def attach(ref: PoolRef) -> torch.Tensor:
    """Map the pool ``ref`` names (read and write, shared with every other mapping)."""
    size = os.stat(ref.path).st_size
    if size != ref.nbytes:
        raise ConfigError("kvtier shared staging pool", f"{ref.path} of {size} bytes",
                          f"{ref.nbytes} bytes, as its creator made it")
    flat = torch.from_file(ref.path, shared=True, size=ref.nbytes, dtype=torch.uint8)
    return flat.view(getattr(torch, ref.dtype)).view(ref.shape)


class SharedPool:
    """A pool tensor in a ``/dev/shm`` file this process created and unlinks at ``close``."""

    def __init__(self, tag: str, shape: tuple[int, ...], dtype: torch.dtype,
                 directory: Path = SHM_DIR) -> None:
        remove_stale(directory)
        name = f"kvtier-vllm-{os.getpid()}-{re.sub(r'[^0-9A-Za-z_.-]', '_', tag)}.pool"
        self.ref = PoolRef(str(directory / name), tuple(shape), str(dtype).removeprefix("torch."))
        nbytes = self.ref.nbytes
        fd = os.open(self.ref.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            os.close(fd)
            os.unlink(self.ref.path)
            free = os.statvfs(directory)
            raise ConfigError("staging_pages (cache.device_pages: the shared staging pool)",
                              f"{nbytes} bytes", f"at most the {free.f_bavail * free.f_frsize} "
                              f"bytes free in {directory} ({exc.strerror}); give the container "
                              "more shared memory or lower staging_pages") from exc
        os.close(fd)
        self.tensor = attach(self.ref)
        self._closed = False

    def close(self) -> None:
        """Unlink the file (mappings stay valid until they are dropped); idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.ref.path)


def remove_stale(directory: Path = SHM_DIR) -> list[Path]:
    """Unlink pools whose creating process is gone; returns what was removed."""
    removed = []
    for path in directory.glob("kvtier-vllm-*.pool"):
        match = _NAME.match(path.name)
        if match is None or _alive(int(match.group(1))):
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
            log.info("kvtier: removed %s, left by a process that ended without closing it", path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:         # someone else's process: alive
        return True
    return True
