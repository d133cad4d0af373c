"""A file store on a directory that cannot be written (a read-only mount; without root, no
write permission) still serves every page it holds, refuses writes (counted, nothing raised),
and refuses a corrupt page without trying to journal its removal. Before, opening it failed
(the journal was opened for appending) and the disk tier went off: every page was lost while
the disk stayed read-only."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kvtier.store import open_store
from kvtier.store.guard import StoreGuard
from store_contract import key_for, page_bytes_for

PAGE = 4096


@contextlib.contextmanager
def _read_only(root: Path) -> Iterator[None]:
    """``root`` made unwritable: remounted read-only as root, else its modes cleared."""
    if os.geteuid() == 0:
        subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
        try:
            yield
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(root)], check=True)
        return
    paths = [root, *root.rglob("*")]
    modes = {p: p.stat().st_mode for p in paths}
    for p in paths:
        p.chmod(modes[p] & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        yield
    finally:
        for p in paths:
            p.chmod(modes[p])


@contextlib.contextmanager
def _small_fs(tmp_path: Path) -> Iterator[Path]:
    """A directory of its own file system when root (so it can be remounted), else tmp."""
    if os.geteuid() != 0:
        yield tmp_path
        return
    mount = tmp_path / "mnt"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _pages(n: int) -> list[bytes]:
    return [page_bytes_for(i, PAGE) for i in range(n)]


def test_a_read_only_store_serves_its_pages_and_refuses_writes(tmp_path: Path) -> None:
    with _small_fs(tmp_path) as root:
        url = f"file://{root}/store"
        store = open_store(url, page_bytes=PAGE)
        assert all(store.write([key_for(i) for i in range(8)], _pages(8)))
        store.close()
        with _read_only(root):
            guard = StoreGuard.open("disk", lambda: open_store(url, page_bytes=PAGE),
                                    page_bytes=PAGE, scheme="file", url=url)
            try:
                assert guard.available
                out = [np.zeros(PAGE, np.uint8) for _ in range(8)]
                assert all(guard.read_into([key_for(i) for i in range(8)], out))
                assert [o.tobytes() for o in out] == _pages(8)
                assert guard.write([key_for(100)], [page_bytes_for(100, PAGE)]) == [False]
                assert guard.stats().errors == 0 and guard.stats().refused == 1  # no IO tried
                guard.supervisor.tick()  # a health check: the store stays open
                assert all(guard.read_into([key_for(i) for i in range(8)], out))
            finally:
                guard.close()


def test_a_corrupt_page_of_a_read_only_store_is_refused_not_raised(tmp_path: Path) -> None:
    with _small_fs(tmp_path) as root:
        url = f"file://{root}/store"
        store = open_store(url, page_bytes=PAGE)
        assert all(store.write([key_for(i) for i in range(4)], _pages(4)))
        store.close()
        segment = next((root / "store" / "segments").glob("*.seg"))
        data = bytearray(segment.read_bytes())
        data[-PAGE // 2] ^= 0xFF  # inside the last page's payload
        segment.write_bytes(bytes(data))
        with _read_only(root):
            store = open_store(url, page_bytes=PAGE)
            try:
                out = [np.zeros(PAGE, np.uint8) for _ in range(4)]
                found = store.read_into([key_for(i) for i in range(4)], out)
                assert found.count(False) == 1
                assert [o.tobytes() for o, f in zip(out, found, strict=True) if f] == [
                    p for p, f in zip(_pages(4), found, strict=True) if f]
            finally:
                store.close()
