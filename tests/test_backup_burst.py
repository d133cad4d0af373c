"""A burst of write-through reaches a real ``file://`` store whole, or the cache says why not.

Each test drains the cache (``drain`` True) and then opens the store directory afresh, as a new
process would, to see what is really on disk.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from cache_support import LAYOUT, make_cache, prompt, serve, store_keys
from kvtier.store.file.store import FileStore
from kvtier.store.wrappers import FaultRule, FaultStore, LatencyStore


def on_disk(root: Path, tokens: list[int]) -> int:
    """Leading pages of ``tokens`` a fresh handle of the store at ``root`` holds."""
    store = FileStore(root, LAYOUT.page_bytes)
    try:
        return store.contains_prefix(store_keys(tokens))
    finally:
        store.close()


def counters(cache: object) -> dict[str, object]:
    return cache.stats()["counters"]  # type: ignore[attr-defined, no-any-return]


def test_a_backup_that_outlives_its_deadline_is_finished_by_the_next_job(tmp_path: Path) -> None:
    store = LatencyStore(FileStore(tmp_path, LAYOUT.page_bytes), write_s=0.3)
    tokens = prompt(48, seed=1)
    with make_cache(device_pages=64, host_pages=128, stores={"disk": store},
                    job_deadline_s=0.2) as cache:
        serve(cache, tokens)
        assert cache.drain(10.0)
        assert counters(cache)["backup_total"]["disk"].get("partial", 0) >= 1  # type: ignore[index, union-attr]
    assert on_disk(tmp_path, tokens) == 48


def test_a_backup_queued_behind_another_is_not_expired_by_its_wait(tmp_path: Path) -> None:
    store = LatencyStore(FileStore(tmp_path, LAYOUT.page_bytes), write_s=0.3)
    prompts = [prompt(16, seed=20 + i) for i in range(2)]   # one batch each: 0.3 s
    with make_cache(device_pages=64, host_pages=128, stores={"disk": store}, io_workers=1,
                    job_deadline_s=0.2) as cache:
        for tokens in prompts:
            serve(cache, tokens)
        assert cache.drain(10.0)
        assert counters(cache)["backup_total"] == {"disk": {"completed": 2}}
    assert [on_disk(tmp_path, tokens) for tokens in prompts] == [16, 16]


def test_a_full_io_queue_holds_backups_back_instead_of_dropping_them(tmp_path: Path) -> None:
    store = LatencyStore(FileStore(tmp_path, LAYOUT.page_bytes), write_s=0.05)
    prompts = [prompt(8, seed=10 + i) for i in range(5)]
    with make_cache(device_pages=64, host_pages=128, stores={"disk": store}, io_workers=1,
                    io_queue_depth=1) as cache:
        for tokens in prompts:
            serve(cache, tokens)
        assert cache.drain(10.0)
        assert counters(cache)["backup_refused_total"]["disk"] >= 1  # type: ignore[index]
    assert [on_disk(tmp_path, tokens) for tokens in prompts] == [8] * 5


def test_a_refused_page_is_counted_and_logged(tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    tokens = prompt(48, seed=2)
    refuse = FaultRule("write", "refuse", keys=frozenset({store_keys(tokens)[20]}))
    store = FaultStore(FileStore(tmp_path, LAYOUT.page_bytes), [refuse])
    with caplog.at_level(logging.WARNING, logger="kvtier.controller.backups"), \
            make_cache(device_pages=64, stores={"disk": store}) as cache:
        serve(cache, tokens)
        assert cache.drain(10.0)
        assert counters(cache)["backup_refused_pages_total"] == {"disk": 28}
    assert on_disk(tmp_path, tokens) == 20
    assert any("28 pages of a 48-page prompt were not stored (refused" in r.getMessage()
               for r in caplog.records)


def test_host_pages_evicted_before_their_backup_are_counted_lost(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = LatencyStore(FileStore(tmp_path, LAYOUT.page_bytes), write_s=0.2)
    tokens = prompt(48, seed=3)
    with caplog.at_level(logging.WARNING, logger="kvtier.controller.backups"), \
            make_cache(device_pages=64, host_pages=64, stores={"disk": store}) as cache:
        serve(cache, tokens)                # 32 pages of staging room: 16 pages wait
        cache.clear_tier("host")            # the waiting pages leave the host tier
        assert cache.drain(10.0)
        lost = counters(cache)["backup_lost_pages_total"]["disk"]  # type: ignore[index]
        assert lost == 48 - on_disk(tmp_path, tokens) > 0
    assert any("(lost: the host tier evicted them first)" in r.getMessage()
               for r in caplog.records)
