"""A store tier that fails open (``StoreGuard`` over real ``file://`` stores): a damaged directory
is moved aside and an empty store opens in its place, a foreign one is left untouched with the
tier off, a store that cannot open is retried until it can, a directory removed under a running
store is noticed and reopened, refused writes make the tier degraded with one warning, and a
backend that raises is answered as failed pages. Settings wrong in themselves still raise."""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.metrics import render_metrics
from kvtier.store import open_store
from kvtier.store.file.segment import MANIFEST
from kvtier.store.guard import GuardSettings, StoreGuard
from kvtier.store.memory import MemoryStore
from kvtier.store.pacing import Backoff, LogLimiter
from kvtier.store.quarantine import identity, set_aside
from kvtier.store.wrappers import FaultRule, FaultStore
from store_contract import key_for, page_bytes_for

PAGE = 4096
FAST = GuardSettings(check_interval_s=0.05, retry_first_s=0.05, retry_max_s=0.2,
                     log_interval_s=60.0)
#: For tests that tick by hand: the guard's own thread never wakes during the test.
MANUAL = GuardSettings(check_interval_s=600.0, retry_first_s=600.0, retry_max_s=600.0)


def guard_over(root: Path, settings: GuardSettings = MANUAL, **options: object) -> StoreGuard:
    url = f"file://{root}"
    opener = functools.partial(open_store, url, page_bytes=PAGE, **options)
    return StoreGuard.open("disk", opener, page_bytes=PAGE, scheme="file", url=url,
                           settings=settings)


def write(store, indexes: range) -> list[bool]:  # type: ignore[no-untyped-def]
    return store.write([key_for(i) for i in indexes], [page_bytes_for(i, PAGE) for i in indexes])


def read(store, i: int) -> bytes | None:  # type: ignore[no-untyped-def]
    out = bytearray(PAGE)
    return bytes(out) if store.read_into([key_for(i)], [out]) == [True] else None


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_a_garbled_manifest_is_moved_aside_and_an_empty_store_opens(tmp_path, caplog) -> None:
    root = tmp_path / "disk"
    with guard_over(root) as guard:
        assert write(guard, range(5)) == [True] * 5
    (root / MANIFEST).write_text('{"format": "kvtier-file-store", "vers')
    before = tree(root)
    with caplog.at_level(logging.ERROR, "kvtier.store"), guard_over(root) as guard:
        assert guard.health()["state"] == "on"
        assert read(guard, 0) is None  # an empty store: the old pages are not served
        assert write(guard, range(3)) == [True] * 3 and read(guard, 2) == page_bytes_for(2, PAGE)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("disk.corrupt-")]
    assert len(aside) == 1 and tree(aside[0]) == before  # kept whole, for inspection
    assert guard.health()["events_total"]["set_aside"] == 1
    assert any("moved it aside to" in r.message and str(aside[0]) in r.message
               for r in caplog.records)


def test_a_store_of_another_page_size_is_left_untouched_and_the_tier_stays_off(
        tmp_path, caplog) -> None:
    root = tmp_path / "disk"
    with open_store(f"file://{root}", page_bytes=2 * PAGE) as other:
        other.write([key_for(0)], [page_bytes_for(0, 2 * PAGE)])
    before = tree(root)
    with caplog.at_level(logging.ERROR, "kvtier.store"), guard_over(root) as guard:
        health = guard.health()
        assert health["state"] == "off" and list(health["problems"]) == ["foreign"]
        assert "a directory of its own" in health["problems"]["foreign"]["message"]
        assert not guard.available and health["retry_in_s"] is not None
        assert read(guard, 0) is None and write(guard, range(2)) == [False, False]
        stats = guard.stats()
        assert (stats.misses, stats.refused) == (1, 2)
    assert tree(root) == before and sorted(p.name for p in tmp_path.iterdir()) == ["disk"]
    assert any(r.levelno == logging.ERROR and "is off, kvtier serves without it" in r.message
               for r in caplog.records)


def test_a_manifest_of_another_format_is_foreign_too(tmp_path) -> None:
    root = tmp_path / "disk"
    root.mkdir()
    (root / MANIFEST).write_text(json.dumps({"format": "kvtier-file-store", "version": 9}))
    before = tree(root)
    with guard_over(root) as guard:
        assert list(guard.health()["problems"]) == ["foreign"]
    assert tree(root) == before and len(list(tmp_path.iterdir())) == 1


def test_settings_wrong_in_themselves_still_raise(tmp_path) -> None:
    opener = functools.partial(open_store, "file://relative/disk", page_bytes=PAGE)
    with pytest.raises(ConfigError, match="relative"):
        StoreGuard.open("disk", opener, page_bytes=PAGE, scheme="file", url="file://relative/disk",
                        settings=MANUAL)


def test_a_store_that_cannot_open_is_retried_in_the_background_until_it_opens(tmp_path) -> None:
    blocker = tmp_path / "mnt"
    blocker.write_text("not a directory yet")  # the store's parent is a file: open fails
    with guard_over(blocker / "disk", FAST) as guard:
        assert guard.health()["state"] == "off"
        assert list(guard.health()["problems"]) == ["unavailable"]
        epoch = guard.epoch
        blocker.unlink()
        deadline = time.monotonic() + 5.0
        while not guard.available and time.monotonic() < deadline:
            time.sleep(0.02)
        assert guard.health()["state"] == "on" and guard.epoch > epoch
        assert write(guard, range(2)) == [True, True]
        assert guard.health()["events_total"]["open_failed"] >= 1


def test_a_directory_removed_under_a_running_store_is_noticed_and_reopened(tmp_path,
                                                                            caplog) -> None:
    root = tmp_path / "disk"
    with guard_over(root) as guard:
        assert write(guard, range(10)) == [True] * 10
        shutil.rmtree(root)
        assert guard.stats().pages == 10 and guard.stats().errors == 0  # nothing noticed it
        epoch = guard.epoch
        with caplog.at_level(logging.ERROR, "kvtier.store"):
            guard.supervisor.tick()
        assert guard.epoch > epoch and guard.health()["events_total"]["lost"] == 1
        assert any("was removed while the store ran" in r.message for r in caplog.records)
        assert read(guard, 3) is None and (root / MANIFEST).exists()
        assert guard.stats().pages == 0
        assert write(guard, range(2)) == [True, True]
        assert guard.stats().bytes_written == 12 * PAGE  # counters carried over the reopen


def test_refused_writes_make_the_tier_degraded_with_one_warning_until_writes_land(
        tmp_path, caplog) -> None:
    root = tmp_path / "disk"
    with guard_over(root, min_free_bytes=1 << 60) as guard:  # a floor no disk is above
        guard.supervisor.tick()  # the counters' baseline
        with caplog.at_level(logging.WARNING, "kvtier.store"):
            for _ in range(3):
                assert write(guard, range(4)) == [False] * 4
                guard.supervisor.tick()
        health = guard.health()
        assert health["state"] == "degraded" and list(health["problems"]) == ["full"]
        message = health["problems"]["full"]["message"]
        assert "4 page writes refused" in message and "floor min_free_bytes 1EiB" not in message
        assert "free space" in message and "min_free_bytes" in message
        warned = [r for r in caplog.records if "degraded" in r.message]
        assert len(warned) == 1 and warned[0].levelno == logging.WARNING  # rate-limited
        text = render_metrics({"cache": {"store_health": {"disk": health}}}).decode()
        assert 'kvtier_store_degraded{reason="full",tier="disk"} 1.0' in text
        assert 'kvtier_store_problems_total{reason="full",tier="disk"} 3.0' in text
        store = guard.slot.current
        store.options = replace(store.options, min_free_bytes=0)
        assert write(guard, range(4)) == [True] * 4
        guard.supervisor.tick()
        assert guard.health()["state"] == "on"


def test_a_store_that_raises_is_answered_as_failed_pages_and_counted(tmp_path) -> None:
    def opener() -> FaultStore:
        return FaultStore(MemoryStore(PAGE), [FaultRule("read", "raise"),
                                              FaultRule("write", "raise")])

    with StoreGuard.open("remote", opener, page_bytes=PAGE, scheme="memory", url="memory://",
                         settings=MANUAL) as guard:
        guard.supervisor.tick()
        assert read(guard, 0) is None and write(guard, range(3)) == [False] * 3
        stats = guard.stats()
        assert (stats.misses, stats.refused, stats.errors) == (1, 3, 4)
        guard.supervisor.tick()
        assert list(guard.health()["problems"]) == ["io_errors"]


def test_set_aside_never_moves_a_directory_other_than_the_one_found_damaged(tmp_path) -> None:
    root = tmp_path / "disk"
    root.mkdir()
    found = identity(root)
    assert found is not None
    os.rename(root, tmp_path / "elsewhere")  # another process moved it aside meanwhile ...
    root.mkdir()                              # ... and created a fresh store in its place
    (root / "fresh").write_text("x")
    assert set_aside(found) is None
    assert (root / "fresh").exists() and len(list(tmp_path.iterdir())) == 2
    moved = set_aside(identity(root), now=0.0)  # type: ignore[arg-type]
    assert moved == tmp_path / "disk.corrupt-19700101T000000Z" and (moved / "fresh").exists()


def test_log_lines_of_one_key_are_held_back_and_counted_within_the_interval(caplog) -> None:
    now = [0.0]
    limiter = LogLimiter(logging.getLogger("kvtier.test"), 60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "kvtier.test"):
        sent = [limiter.log(logging.WARNING, "full", f"line {i}") for i in range(5)]
        assert limiter.log(logging.WARNING, "other", "another key")
        now[0] = 61.0
        assert limiter.log(logging.WARNING, "full", "line 5")
    assert sent == [True, False, False, False, False]
    assert [r.message for r in caplog.records] == [
        "line 0", "another key", "line 5 (4 more like this in the last 61 s)"]


def test_backoff_doubles_to_its_cap_within_its_jitter() -> None:
    backoff = Backoff(1.0, 30.0, jitter=0.2, seed=7)
    delays = [backoff.next() for _ in range(8)]
    for delay, base in zip(delays, [1, 2, 4, 8, 16, 30, 30, 30], strict=True):
        assert 0.8 * base <= delay <= 1.2 * base
    backoff.reset()
    assert backoff.next() <= 1.2


def test_a_manifest_that_is_valid_json_but_no_manifest_is_damaged(tmp_path) -> None:
    root = tmp_path / "disk"
    root.mkdir()
    (root / MANIFEST).write_text(json.dumps(["not", "a", "manifest"]))
    with guard_over(root) as guard:
        assert guard.health()["state"] == "on" and guard.health()["events_total"]["set_aside"]
