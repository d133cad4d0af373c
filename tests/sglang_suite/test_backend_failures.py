"""Misses, corrupt pages and failing stores are answered as misses, never as exceptions."""

from __future__ import annotations

from pathlib import Path

from sglang_helpers import fill_random, make_pool, names, page_bytes, page_slots

from kvtier.store.wrappers import FaultRule, FaultStore


def _disk_stats(backend) -> dict:
    return backend.stats()["tiers"]["disk"]


def test_batch_exists_counts_the_stored_prefix_without_reading_pages(backends, disk_url):
    pool = make_pool("mha", "page_first")
    backend = backends(pool, disk_url)
    fill_random(pool, seed=5)
    keys = names(6)
    assert all(backend.batch_set_v1(keys[:4], page_slots(pool, [0, 1, 2, 3])))
    before = _disk_stats(backend)
    assert backend.batch_exists(keys) == 4
    assert backend.batch_exists(keys[1:]) == 3
    assert backend.batch_exists(keys[4:]) == 0
    assert backend.exists(keys[0]) and not backend.exists(keys[5])
    after = _disk_stats(backend)
    assert after["bytes_read"] == before["bytes_read"]
    assert after["hits"] == before["hits"] and after["misses"] == before["misses"]


def test_missing_pages_end_the_loaded_prefix(backends, disk_url):
    pool = make_pool("mha", "layer_first")
    backend = backends(pool, disk_url)
    fill_random(pool, seed=6)
    keys = names(4)
    assert all(backend.batch_set_v1([keys[0], keys[1], keys[3]], page_slots(pool, [0, 1, 3])))
    assert backend.batch_exists(keys) == 2
    got = backend.batch_get_v1(keys, page_slots(pool, [10, 11, 12, 13]))
    assert got == [True, True, False, True]


def test_corrupt_page_on_disk_is_a_miss_and_other_pages_still_load(backends, disk_url):
    pool = make_pool("mla", "page_first_direct")
    backend = backends(pool, disk_url, mla=True)
    fill_random(pool, seed=7)
    keys = names(3)
    expected = [page_bytes(pool, p) for p in (0, 1, 2)]
    assert all(backend.batch_set_v1(keys, page_slots(pool, [0, 1, 2])))
    _corrupt_stored_payload(backend, expected[1])
    pool.kv_buffer.zero_()
    got = backend.batch_get_v1(keys, page_slots(pool, [5, 6, 7]))
    assert got == [True, False, True]
    assert page_bytes(pool, 5) == expected[0] and page_bytes(pool, 7) == expected[2]
    assert _disk_stats(backend)["corrupt"] == 1


def _corrupt_stored_payload(backend, payload: bytes) -> None:
    """Flip one byte of a stored page, found on disk by its (random, so unique) bytes."""
    root = backend.tiers.tiers[0][1].root
    for segment in sorted(Path(root).rglob("*.seg")):
        data = bytearray(segment.read_bytes())
        at = data.find(payload)
        if at >= 0:
            data[at + 10] ^= 0xFF
            segment.write_bytes(bytes(data))
            return
    raise AssertionError("stored page not found on disk")


def test_store_that_raises_answers_misses_and_refusals(backends, disk_url):
    pool = make_pool("mha", "page_first")
    backend = backends(pool, disk_url)
    fill_random(pool, seed=8)
    keys = names(3)
    assert all(backend.batch_set_v1(keys, page_slots(pool, [0, 1, 2])))
    name, store = backend.tiers.tiers[0]
    faulty = FaultStore(store, [FaultRule(op=op, kind="raise") for op in ("read", "write", "contains")])
    backend.tiers.tiers[0] = (name, faulty)
    assert backend.batch_get_v1(keys, page_slots(pool, [4, 5, 6])) == [False] * 3
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(names(2, "x"), page_slots(pool, [7, 8])) == [False] * 2
    assert backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys]) == [None] * 3
    assert backend.stats()["chain_errors"] >= 4


def test_wrong_slot_count_is_refused_without_raising(backends, disk_url):
    pool = make_pool("mha", "page_first")
    backend = backends(pool, disk_url)
    keys = names(2)
    slots = page_slots(pool, [0, 1])[:-1]
    assert backend.batch_set_v1(keys, slots) == [False, False]
    assert backend.batch_get_v1(keys, slots) == [False, False]
    assert backend.batch_set(keys, [pool.get_dummy_flat_data_page()]) is False


def test_flush_leaves_the_persistent_tier_intact(backends, disk_url):
    pool = make_pool("mha", "page_first")
    backend = backends(pool, disk_url)
    keys = names(2)
    assert all(backend.batch_set_v1(keys, page_slots(pool, [0, 1])))
    backend.clear()
    assert backend.batch_exists(keys) == 2
