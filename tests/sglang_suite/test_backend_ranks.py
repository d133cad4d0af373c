"""Tensor-parallel ranks keep their own pages; MLA ranks share one page that one rank writes."""

from __future__ import annotations

import pytest
from sglang_helpers import fill_random, make_pool, names, page_bytes, page_slots

from kvtier.errors import ConfigError


def test_tp_ranks_store_their_own_heads_under_one_sglang_name(backends, disk_url):
    pools = [make_pool("mha", "page_first") for _ in range(2)]
    ranks = [backends(pool, disk_url, tp_rank=r, tp_size=2) for r, pool in enumerate(pools)]
    for rank, pool in enumerate(pools):
        fill_random(pool, seed=10 + rank)
    expected = [page_bytes(pool, 0) for pool in pools]
    keys = names(1)
    for backend, pool in zip(ranks, pools, strict=True):
        assert backend.batch_set_v1(keys, page_slots(pool, [0])) == [True]
    assert ranks[0].describe()["shard"] != ranks[1].describe()["shard"]
    for backend, pool, want in zip(ranks, pools, expected, strict=True):
        pool.kv_buffer.zero_()
        assert backend.batch_get_v1(keys, page_slots(pool, [3])) == [True]
        assert page_bytes(pool, 3) == want
    assert ranks[0].stats()["tiers"]["disk"]["pages"] == 2


def test_mla_non_writer_rank_skips_writes_and_reads_the_writers_page(backends, disk_url):
    pools = [make_pool("mla", "page_first") for _ in range(2)]
    writer, follower = (backends(pool, disk_url, tp_rank=r, tp_size=2, mla=True)
                        for r, pool in enumerate(pools))
    assert writer.describe()["writer"] and not follower.describe()["writer"]
    fill_random(pools[0], seed=12)
    fill_random(pools[1], seed=13)  # a follower's bytes never reach the store
    keys = names(2)
    assert follower.batch_set_v1(keys, page_slots(pools[1], [0, 1])) == [True, True]
    assert follower.batch_exists(keys) == 0
    assert writer.batch_set_v1(keys, page_slots(pools[0], [0, 1])) == [True, True]
    assert follower.batch_exists(keys) == 2
    assert follower.batch_get_v1(keys, page_slots(pools[1], [4, 5])) == [True, True]
    assert page_bytes(pools[1], 4) == page_bytes(pools[0], 0)
    assert writer.stats()["tiers"]["disk"]["pages"] == 2


def test_ranks_replicating_heads_share_a_page_and_only_the_first_writes(backends, disk_url):
    # 4 TP ranks of 1 KV head each, for a model with 2 KV heads: ranks 0,1 hold head 0; 2,3 head 1.
    pools = [make_pool("mha", "page_first", heads=1) for _ in range(4)]
    ranks = [backends(pool, disk_url, tp_rank=r, tp_size=4, kv_heads_total=2)
             for r, pool in enumerate(pools)]
    assert [b.describe()["writer"] for b in ranks] == [True, False, True, False]
    assert ranks[0].describe()["shard"] == ranks[1].describe()["shard"]
    assert ranks[1].describe()["shard"] != ranks[2].describe()["shard"]
    fill_random(pools[0], seed=14)
    keys = names(1)
    assert ranks[0].batch_set_v1(keys, page_slots(pools[0], [0])) == [True]
    assert ranks[1].batch_get_v1(keys, page_slots(pools[1], [2])) == [True]
    assert page_bytes(pools[1], 2) == page_bytes(pools[0], 0)
    assert ranks[2].batch_exists(keys) == 0


def test_pipeline_stages_with_the_same_page_shape_keep_separate_pages(backends, disk_url):
    pools = [make_pool("mha", "page_first") for _ in range(2)]
    stages = [backends(pool, disk_url, pp_rank=r, pp_size=2) for r, pool in enumerate(pools)]
    fill_random(pools[0], seed=15)
    keys = names(2)
    assert all(stages[0].batch_set_v1(keys, page_slots(pools[0], [0, 1])))
    assert stages[1].batch_exists(keys) == 0
    assert stages[0].batch_exists(keys) == 2


def test_inconsistent_head_total_is_refused_at_registration(backends, disk_url):
    with pytest.raises(ConfigError):
        backends(make_pool("mha", "page_first", heads=2), disk_url, tp_size=2, kv_heads_total=3)


def test_models_with_the_same_page_shape_do_not_share_pages(backends, disk_url):
    a_pool, b_pool = make_pool("mha", "page_first"), make_pool("mha", "page_first")
    a = backends(a_pool, disk_url, model="org/model-a")
    b = backends(b_pool, disk_url, model="org/model-b")
    keys = names(2)
    assert all(a.batch_set_v1(keys, page_slots(a_pool, [0, 1])))
    assert b.batch_exists(keys) == 0
    assert b.batch_get_v1(keys, page_slots(b_pool, [0, 1])) == [False, False]


def test_unknown_kvtier_setting_is_refused_with_its_name(backends, disk_url):
    with pytest.raises(ConfigError, match="dsik_url"):
        backends(make_pool("mha", "page_first"), disk_url, dsik_url="file:///tmp/x")
