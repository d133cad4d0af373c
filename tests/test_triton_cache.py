"""kvtier's Triton cache manager: many processes publishing and reading the same entries."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from pathlib import Path

import pytest

from kvtier.transfer import triton_cache
from kvtier.transfer.triton_cache import MANAGER_SPEC, KvtierCacheManager, install_triton_cache

ENTRIES = [f"ENTRY{i:02d}" for i in range(6)]
FILES = {"kernel.cubin": 200_000, "kernel.ptx": 50_000, "kernel.json": 300}


def _payload(entry: str, name: str) -> bytes:
    seed = f"{entry}/{name}".encode()
    return (seed * (FILES[name] // len(seed) + 1))[:FILES[name]]


def _compile_like_triton(entry: str) -> dict[str, str]:
    """What Triton does per kernel: look up the group, else put every file, then the group."""
    manager = KvtierCacheManager(entry)
    group = manager.get_group("kernel.json")
    if group is None:
        paths = {name: manager.put(_payload(entry, name), name) for name in FILES}
        manager.put_group("kernel.json", paths)
        group = manager.get_group("kernel.json")
    assert group is not None, f"{entry}: group missing right after it was published"
    for name, path in group.items():
        data = Path(path).read_bytes()
        assert data == _payload(entry, name), f"{entry}/{name}: read {len(data)} wrong bytes"
    return group


def _writer(cache_dir: str, rounds: int, start: mp.synchronize.Barrier, errors: mp.Queue) -> None:
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    try:
        start.wait()
        for _ in range(rounds):
            for entry in ENTRIES:
                _compile_like_triton(entry)
    except BaseException:
        errors.put(traceback.format_exc())


def _lister(cache_dir: str, rounds: int, start: mp.synchronize.Barrier, errors: mp.Queue) -> None:
    """Lists entry directories and opens everything it sees, as another process's scan would."""
    try:
        start.wait()
        for _ in range(rounds):
            for entry in ENTRIES:
                folder = Path(cache_dir, entry)
                if not folder.is_dir():
                    continue
                for child in os.listdir(folder):
                    with open(folder / child, "rb") as handle:
                        handle.read(1)
    except BaseException:
        errors.put(traceback.format_exc())


def _run_processes(targets: list, cache_dir: str, rounds: int) -> list[str]:
    ctx = mp.get_context("fork")
    start, errors = ctx.Barrier(len(targets)), ctx.Queue()
    procs = [ctx.Process(target=t, args=(cache_dir, rounds, start, errors)) for t in targets]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    found = []
    while not errors.empty():
        found.append(errors.get())
    found += [f"exit code {p.exitcode}" for p in procs if p.exitcode != 0 and not found]
    return found


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    return str(tmp_path)


def test_many_processes_publish_and_read_the_same_entries_without_errors(cache_dir) -> None:
    errors = _run_processes([_writer] * 6 + [_lister] * 2, cache_dir, rounds=4)
    assert errors == []
    for entry in ENTRIES:
        assert _compile_like_triton(entry).keys() == set(FILES)
        assert sorted(os.listdir(Path(cache_dir, entry))) == sorted(
            [*FILES, "__grp__kernel.json"])
    assert os.listdir(Path(cache_dir, ".kvtier-tmp")) == []


def test_second_publisher_keeps_the_first_copy(cache_dir) -> None:
    first = KvtierCacheManager("ENTRY")
    path = first.put(b"x" * 100, "kernel.cubin")
    inode = os.stat(path).st_ino
    assert KvtierCacheManager("ENTRY").put(b"x" * 100, "kernel.cubin") == path
    assert os.stat(path).st_ino == inode


def test_group_with_a_missing_or_unreadable_file_is_a_miss(cache_dir) -> None:
    manager = KvtierCacheManager("ENTRY")
    paths = {name: manager.put(_payload("ENTRY", name), name) for name in FILES}
    manager.put_group("kernel.json", paths)
    assert manager.get_group("kernel.json") == paths
    os.unlink(paths["kernel.ptx"])
    assert manager.get_group("kernel.json") is None
    Path(cache_dir, "ENTRY", "__grp__kernel.json").write_text("{not json")
    assert manager.get_group("kernel.json") is None
    assert manager.get_group("other.json") is None


def test_text_data_is_stored_as_utf8(cache_dir) -> None:
    path = KvtierCacheManager("ENTRY").put("kernel source", "kernel.ttir", binary=False)
    assert Path(path).read_text() == "kernel source"
    assert KvtierCacheManager("ENTRY").get_file("kernel.ttir") == path
    assert KvtierCacheManager("ENTRY").get_file("absent") is None


def test_install_makes_triton_use_the_kvtier_manager(cache_dir, monkeypatch) -> None:
    from triton import knobs
    from triton.runtime.cache import get_cache_manager

    monkeypatch.delenv("TRITON_CACHE_MANAGER", raising=False)
    with knobs.cache.scope():
        assert install_triton_cache(cache_dir)
        assert os.environ["TRITON_CACHE_MANAGER"] == MANAGER_SPEC
        manager = get_cache_manager("ab" * 32)
        assert isinstance(manager, KvtierCacheManager)
        assert manager.cache_dir.startswith(cache_dir)
        assert install_triton_cache()  # idempotent


def test_install_leaves_a_manager_the_user_chose(cache_dir, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_MANAGER", "triton.runtime.cache:FileCacheManager")
    assert install_triton_cache() is False
    assert os.environ["TRITON_CACHE_MANAGER"] == "triton.runtime.cache:FileCacheManager"


def test_override_and_dump_managers_keep_tritons_behaviour(cache_dir, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_DUMP_DIR", os.path.join(cache_dir, "dump"))
    manager = KvtierCacheManager("ENTRY", dump=True)
    path = manager.put(b"ir", "kernel.ttir")
    assert Path(path).read_bytes() == b"ir"
    assert triton_cache._TMP_DIR not in os.listdir(os.path.join(cache_dir, "dump"))
