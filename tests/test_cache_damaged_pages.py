"""A store page that fails verification is served as a miss once and stored again by the request
that missed it: the next request after a flush hits the whole prompt on that store again (disk
segments damaged on disk, Redis values damaged on the server)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cache_support import LAYOUT, P, make_cache, prompt, serve, store_keys
from kvtier.cache import TieredCache
from kvtier.store import open_store
from kvtier.store.base import PageStore
from kvtier.store.file import FileStore
from kvtier.store.file.index import split
from kvtier.store.file.segment import segment_path
from redis_server import needs_redis, running_server

PAGES = 6
BAD = 3


def _damage_file_page(store: FileStore, key: bytes) -> None:
    seg, slot = split(store.index.where[key])
    with open(segment_path(store.segments_dir, seg), "r+b") as f:
        f.seek(store.layout.payload_at(slot) + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x20]))


def _round(cache: TieredCache, tokens: list[int], tier: str) -> int:
    """Flush the fast tiers, serve ``tokens``; the pages that came from ``tier``."""
    cache.flush()
    hit, loaded = serve(cache, tokens)
    assert cache.drain()
    cache.check_integrity()
    return min(loaded.tokens, hit.tokens_by_tier[tier]) // P


def _served_once_as_a_miss_then_stored_again(store: PageStore, tier: str, damage) -> None:
    tokens = prompt(PAGES, seed=41)
    with make_cache(stores={tier: store}) as cache:
        serve(cache, tokens)
        assert cache.drain()
        damage(store_keys(tokens)[BAD])
        assert _round(cache, tokens, tier) == BAD  # the damaged page is a miss, once
        assert store.stats().corrupt == 1
        assert _round(cache, tokens, tier) == PAGES  # stored again by the request that missed
        assert _round(cache, tokens, tier) == PAGES
        assert store.stats().corrupt == 1 and store.stats().dropped == 1


def test_damaged_disk_page_is_a_miss_once_then_stored_again(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}", page_bytes=LAYOUT.page_bytes)
    assert isinstance(store, FileStore)
    _served_once_as_a_miss_then_stored_again(store, "disk",
                                             lambda key: _damage_file_page(store, key))


@needs_redis
@pytest.mark.redis
def test_damaged_redis_page_is_a_miss_once_then_stored_again(tmp_path: Path) -> None:
    with running_server(tmp_path) as server, server.client() as raw:
        store = open_store(server.url(), page_bytes=LAYOUT.page_bytes, prefix="dmg:")

        def damage(key: bytes) -> None:
            name = b"dmg:" + key.hex().encode()
            raw.set(name, raw.get(name)[:-3])

        _served_once_as_a_miss_then_stored_again(store, "remote", damage)
