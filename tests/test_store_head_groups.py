"""Head-group records: ranks of one TP size write their heads, ranks of another read theirs,
byte for byte the slices of the whole page; through a bare store and through TieredCache."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from cache_support import LAYOUT as CACHE_LAYOUT
from cache_support import NAMESPACE, P, pattern, prompt
from kvtier.cache import TieredCache
from kvtier.config import build_config
from kvtier.errors import ConfigError
from kvtier.layout import KVLayout
from kvtier.store.head_groups import HeadGroupStore, group_layout
from kvtier.store.memory import MemoryStore

LAYOUT = KVLayout(num_layers=3, num_kv_heads=8, head_dim=4, dtype="bfloat16", page_size=2)


def _pages(n: int) -> np.ndarray:
    """Whole pages, [n, layers, parts, page_size, heads, dim] as uint16."""
    rng = np.random.default_rng(7)
    return rng.integers(0, 1 << 16, (n, *LAYOUT.page_shape()), dtype=np.uint16)


def _view(inner: MemoryStore, heads: tuple[int, int], per_record: int = 1) -> HeadGroupStore:
    return HeadGroupStore(inner, LAYOUT, heads, per_record)


@pytest.mark.parametrize(("writers", "readers", "per_record"),
                         [(2, 1, 1), (2, 4, 1), (4, 2, 1), (1, 8, 1), (2, 4, 2)])
def test_pages_written_by_one_tp_size_read_back_by_another(writers, readers, per_record):
    inner = MemoryStore(group_layout(LAYOUT, per_record).page_bytes)
    pages = _pages(3)
    keys = [bytes([i]) * 32 for i in range(3)]
    for rank in range(writers):
        h0, h1 = LAYOUT.head_range_for_rank(rank, writers)
        shares = [np.ascontiguousarray(p[:, :, :, h0:h1]) for p in pages]
        assert _view(inner, (h0, h1), per_record).write(keys, shares) == [True] * 3
    for rank in range(readers):
        h0, h1 = LAYOUT.head_range_for_rank(rank, readers)
        view = _view(inner, (h0, h1), per_record)
        out = [np.zeros(view.page_bytes // 2, dtype=np.uint16) for _ in keys]
        assert view.contains(keys) == [True] * 3
        assert view.read_into(keys, out) == [True] * 3
        for got, page in zip(out, pages, strict=True):
            assert np.array_equal(got.reshape(page[:, :, :, h0:h1].shape), page[:, :, :, h0:h1])


def test_a_page_is_present_only_where_every_group_of_the_rank_is():
    inner = MemoryStore(group_layout(LAYOUT, 1).page_bytes)
    key = b"k" * 32
    page = _pages(1)[0]
    _view(inner, (0, 8)).write([key], [page])
    inner.delete([_view(inner, (6, 8)).group_keys(key)[1]])  # head 7's record
    full, low, high = _view(inner, (0, 8)), _view(inner, (0, 4)), _view(inner, (4, 8))
    assert (full.contains([key]), low.contains([key]), high.contains([key])) == (
        [False], [True], [False])
    buffer = np.zeros(high.page_bytes, dtype=np.uint8)
    assert high.read_into([key], [buffer]) == [False]
    assert low.delete([key]) == 1 and low.contains([key]) == [False]


def test_bad_groupings_are_refused():
    with pytest.raises(ConfigError, match="heads_per_record"):
        group_layout(LAYOUT, 3)
    with pytest.raises(ConfigError, match="heads_per_record"):
        _view(MemoryStore(group_layout(LAYOUT, 2).page_bytes), (1, 3), 2)
    with pytest.raises(ValueError, match="records"):
        _view(MemoryStore(LAYOUT.page_bytes), (0, 4), 1)


def _rank_cache(heads: tuple[int, int], name: str) -> TieredCache:
    share = CACHE_LAYOUT.for_heads(heads)
    flags = {"cache.page_size": P, "cache.device_pages": 16, "host.pool_bytes": 32 * share.page_bytes,
             "controller.min_prefetch_tokens": 0, "controller.prefetch_policy": "wait_complete"}
    inner = MemoryStore(group_layout(CACHE_LAYOUT, 1).page_bytes, name=name)
    return TieredCache.build(build_config(env={}, flags=flags), CACHE_LAYOUT, NAMESPACE,
                             stores={"disk": inner}, heads=heads)


def test_tiered_caches_of_two_ranks_store_what_one_whole_cache_loads():
    name, tokens = f"heads-{uuid.uuid4().hex}", prompt(4, seed=3)
    for heads in ((0, 1), (1, 2)):
        with _rank_cache(heads, name) as rank:
            assert rank.device_pool.kv.shape[-2] == 1
            ids = rank.allocate(4)
            for i, page_id in enumerate(ids):
                rank.device_pool.kv[:, :, page_id] = pattern(tokens[i * P:(i + 1) * P])[
                    :, :, :, heads[0]:heads[1]]
            rank.commit(tokens, ids)
            assert rank.drain(5.0)
    with _rank_cache((0, 2), name) as whole:
        hit = whole.match(tokens)
        loaded = whole.load(hit)
        assert hit.tokens_by_tier["disk"] == loaded.tokens == 4 * P
        for i, page_id in enumerate(loaded.device_page_ids):
            assert torch.equal(whole.device_pool.kv[:, :, page_id],
                               pattern(tokens[i * P:(i + 1) * P]))
        whole.release(loaded)


def test_a_rank_cache_whose_heads_are_not_whole_groups_is_refused_before_stores_open(tmp_path):
    flags = {"cache.page_size": P, "cache.device_pages": 4, "host.pool_bytes": 1 << 20,
             "store.disk_url": f"file://{tmp_path / 'store'}"}
    with pytest.raises(ConfigError, match="heads_per_record"):
        TieredCache.build(build_config(env={}, flags=flags), CACHE_LAYOUT, NAMESPACE,
                          heads=(1, 2), heads_per_record=2)
    assert not (tmp_path / "store").exists()
