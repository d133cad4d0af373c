"""Full fill/drain cycles of the host tier return every byte, slot, page and charge."""

from __future__ import annotations

import torch

from kvtier.keys import KEY_BYTES
from kvtier.layout import KVLayout
from kvtier.memory import HostPool, PinnedBudget, ReadRing, WriteAdmission
from kvtier.store.memory import MemoryStore

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)
POOL_PAGES = 8


def key(i: int) -> bytes:
    return i.to_bytes(KEY_BYTES, "big")


def state(budget, pool, ring, adm) -> dict:
    return {"held": budget.held_bytes, "owners": {k: v["bytes"] for k, v in
                                                  budget.stats()["owners"].items()},
            "pool_free": pool.allocator.num_free, "ring_free": ring.free_slots,
            "ring_out": ring.stats()["slots_in_use"] + ring.stats()["overflow_in_use"],
            "staging_used": adm.used_pages, "charges": adm.stats()["charges"]}


def write_through(pool, adm, store, cycle: int) -> int:
    """Stage pages until admission refuses; every op ends by ack or failure."""
    written = 0
    for i in range(POOL_PAGES):
        op = ("write", cycle, i)
        if not adm.admit(op, 1):
            continue
        (h,) = pool.allocator.allocate(1)
        adm.occupy(op, 1)
        pool.page(h).fill_(i)  # a key names its content: same key, same bytes
        ok = store.write([key(i)], [pool.page(h)]) == [True] and i % 3 != 2
        adm.release(op, "ack" if ok else "failure")
        pool.allocator.free([h])
        written += 1
    return written


def prefetch_fill(pool, ring, store) -> list[int]:
    """Fill the whole pool with stored pages read through the ring."""
    ids = pool.allocator.allocate(POOL_PAGES)
    for n, h in enumerate(ids):
        with ring.borrow() as buf:
            assert store.read_into([key(n % 4)], [buf]) == [True]
            pool.copy_page_in(h, buf)
    return ids


def test_three_fill_drain_cycles_return_to_the_start():
    budget = PinnedBudget(1 << 20)
    pool = HostPool(LAYOUT, POOL_PAGES, budget)
    ring = ReadRing(2, LAYOUT.page_bytes, budget)
    adm = WriteAdmission.for_host_pool(POOL_PAGES, 0.5)
    store = MemoryStore(LAYOUT.page_bytes)
    start = state(budget, pool, ring, adm)
    for cycle in range(3):
        assert write_through(pool, adm, store, cycle) == POOL_PAGES
        ids = prefetch_fill(pool, ring, store)
        assert pool.allocator.num_free == 0
        assert torch.all(pool.page(ids[1]) == 1)
        pool.allocator.free(ids)
        pool.allocator.check_integrity()
        assert state(budget, pool, ring, adm) == start
    ring.close()
    pool.close()
    assert budget.held_bytes == 0


def test_burst_beyond_staging_is_refused_and_leaves_pool_and_store_untouched():
    budget = PinnedBudget(1 << 20)
    pool = HostPool(LAYOUT, POOL_PAGES, budget)
    adm = WriteAdmission.for_host_pool(POOL_PAGES, 0.5)
    store = MemoryStore(LAYOUT.page_bytes)
    held = []
    for i in range(POOL_PAGES):
        if adm.admit(("burst", i), 1):
            held.append(pool.allocator.allocate(1)[0])
            adm.occupy(("burst", i), 1)
    assert len(held) == adm.capacity_pages == 4
    assert adm.stats()["refused_total"] == 4
    assert pool.allocator.num_free == POOL_PAGES - 4  # refusals allocated nothing
    assert store.stats().pages == 0  # and wrote nothing
    for i in range(4):
        adm.release(("burst", i), "detach")
    pool.allocator.free(held)
    assert adm.used_pages == 0 and pool.allocator.num_free == POOL_PAGES
