"""kvtier's Triton cache manager: many processes may compile the same kernels into one cache.

Owns ``KvtierCacheManager`` and ``install_triton_cache()``, the one place kvtier points Triton at
its cache manager. Triton's default manager writes each file into a temporary directory inside
the entry's own directory and then removes that directory with ``os.removedirs``, which also
tries to remove the (momentarily empty) entry directory above it; a process that lists or
creates files there at the same moment can die with ``FileNotFoundError``. Tensor-parallel ranks
and replicas that start together hit exactly that.

This manager publishes atomically and under a lock:

- temporary files live in ``<cache>/.kvtier-tmp/``, never inside an entry directory, and each
  has a unique name (pid and a random id), so readers never see a partial or vanishing file;
- a file is published with ``os.replace`` (atomic on POSIX) while holding an exclusive
  ``fcntl`` lock on ``<cache>/.kvtier-locks/<entry>.lock``; a writer that finds the file already
  published by another process keeps that copy and writes nothing;
- nothing kvtier creates in the cache is ever removed, so a path once returned stays valid.

``install_triton_cache()`` sets ``TRITON_CACHE_MANAGER`` (inherited by child processes) and
Triton's in-process knob, unless the user already chose a manager. ``launch_copy`` calls it
before every launch (idempotent, cheap), so it is in place before kvtier's first compile; an
entry point may call it earlier to cover other kernels too. Safe from any thread or process.
"""

# Triton ships no type information: its FileCacheManager (subclassed here) is untyped.
# mypy: disable-error-code="misc,no-any-return"
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

from triton.runtime.cache import FileCacheManager

#: What ``TRITON_CACHE_MANAGER`` is set to (Triton's "module:Class" form).
MANAGER_SPEC = "kvtier.transfer.triton_cache:KvtierCacheManager"
_TMP_DIR = ".kvtier-tmp"
_LOCK_DIR = ".kvtier-locks"


class KvtierCacheManager(FileCacheManager):
    """A file cache whose publish is atomic and lock-protected (see the module docstring).

    Override and dump directories (debugging features) keep Triton's own behaviour.
    """

    def __init__(self, key: str, override: bool = False, dump: bool = False) -> None:
        self._plain = override or dump
        if self._plain:
            super().__init__(key, override=override, dump=dump)
            return
        self.key = key
        self.root = _cache_root()
        self.cache_dir = os.path.join(self.root, key)
        self.lock_path = os.path.join(self.root, _LOCK_DIR, f"{key}.lock")
        for path in (self.cache_dir, os.path.join(self.root, _TMP_DIR),
                     os.path.join(self.root, _LOCK_DIR)):
            os.makedirs(path, exist_ok=True)

    def put(self, data: bytes | str, filename: str, binary: bool = True) -> str:
        if self._plain:
            return super().put(data, filename, binary)
        payload = data if isinstance(data, bytes) else str(data).encode()
        target = self._make_path(filename)
        with self._locked():
            if os.path.exists(target) and os.path.getsize(target) == len(payload):
                return target  # another process published it; identical key, identical bytes
            temp = os.path.join(self.root, _TMP_DIR,
                                f"{self.key}.{filename}.{os.getpid()}.{uuid.uuid4().hex}")
            try:
                with open(temp, "wb") as handle:
                    handle.write(payload)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(temp, target)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp)
        return target

    def get_group(self, filename: str) -> dict[str, str] | None:
        if self._plain:
            return super().get_group(filename)
        group_path = self._make_path(f"__grp__{filename}")
        try:
            with open(group_path) as handle:
                child_paths = json.load(handle).get("child_paths")
        except (OSError, ValueError):
            return None
        if not isinstance(child_paths, dict):
            return None
        result = {}
        for name, path in child_paths.items():
            # Paths are recorded absolute; look in this cache's entry in case the cache moved.
            local = self._make_path(os.path.basename(path))
            if not os.path.exists(local):
                return None
            result[name] = local
        return result

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.lock_path, "a+") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _cache_root() -> str:
    knobs = _knobs()
    root = knobs.cache.dir if knobs is not None else os.environ.get(
        "TRITON_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".triton", "cache"))
    if not root:
        raise RuntimeError("Triton has no cache directory (set TRITON_CACHE_DIR)")
    return root


def install_triton_cache(cache_dir: str | None = None) -> bool:
    """Make Triton use ``KvtierCacheManager`` (and ``cache_dir``, if given) in this process and
    its children. Returns False (and changes nothing) if another manager was chosen already."""
    knobs = _knobs()
    if cache_dir is not None:
        os.environ["TRITON_CACHE_DIR"] = cache_dir
        if knobs is not None:
            knobs.cache.dir = cache_dir
    current = os.environ.get("TRITON_CACHE_MANAGER")
    if current not in (None, "", MANAGER_SPEC):
        return False
    os.environ["TRITON_CACHE_MANAGER"] = MANAGER_SPEC
    if knobs is None:  # a Triton without knobs reads the variable at each lookup
        return True
    if knobs.cache.manager_class not in (None, KvtierCacheManager):
        return False
    knobs.cache.manager_class = KvtierCacheManager
    return True


def _knobs() -> Any:
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs
