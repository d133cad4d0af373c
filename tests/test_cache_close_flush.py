"""Write-back at close: what only memory holds reaches the stores before the cache closes (a
restart hits it on disk), within ``controller.close_flush_s``; what the bound leaves out is
counted and logged with its pages and bytes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from cache_support import LAYOUT, P, make_cache, prompt, serve
from kvtier.store import open_store
from kvtier.store.base import PageStore
from kvtier.store.wrappers import LatencyStore

PROMPTS = [prompt(6, seed=70 + i) for i in range(3)]


def _disk(path: Path) -> PageStore:
    return open_store(f"file://{path}", page_bytes=LAYOUT.page_bytes)


def _disk_hits(path: Path) -> list[int]:
    """Pages of each prompt a fresh cache over the same directory finds on disk."""
    with make_cache(stores={"disk": _disk(path)}) as cache:
        return [cache.match(tokens).tokens_by_tier["disk"] // P for tokens in PROMPTS]


@pytest.mark.parametrize("host_pages", [64, 8])  # 8: less host room than the device holds
def test_write_back_pages_reach_the_disk_at_close(tmp_path: Path, host_pages: int) -> None:
    cache = make_cache(device_pages=32, host_pages=host_pages, write_policy="write_back",
                       stores={"disk": _disk(tmp_path)})
    for tokens in PROMPTS:
        serve(cache, tokens)
    assert cache.drain()
    assert cache.stats()["tiers"]["host"]["pages"] == 0  # nothing evicted: memory only
    cache.close()
    assert cache.stats()["counters"]["close_flush_total"] == 1
    assert _disk_hits(tmp_path) == [6, 6, 6]


def test_flush_at_close_is_bounded_and_says_what_it_lost(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    slow = LatencyStore(_disk(tmp_path), write_s=1.5)  # two IO workers: a third job waits
    cache = make_cache(device_pages=32, write_policy="write_back", stores={"disk": slow},
                       close_flush_s=0.1)
    for tokens in PROMPTS:
        serve(cache, tokens)
    with caplog.at_level(logging.WARNING, logger="kvtier.controller.close_flush"):
        cache.close()
    lost = cache.stats()["counters"]["close_flush_dropped_pages_total"]["disk"]
    assert 0 < lost < 18  # the backups running at the bound still ended
    assert f"{lost} pages ({lost * LAYOUT.page_bytes} bytes)" in caplog.text, caplog.text
    assert "controller.close_flush_s=0.1s" in caplog.text
    assert sum(_disk_hits(tmp_path)) == 18 - lost


def test_a_zero_bound_does_not_flush(tmp_path: Path) -> None:
    cache = make_cache(write_policy="write_back", stores={"disk": _disk(tmp_path)},
                       close_flush_s=0)
    serve(cache, PROMPTS[0])
    cache.close()
    assert "close_flush_total" not in cache.stats()["counters"]
    assert _disk_hits(tmp_path)[0] == 0
