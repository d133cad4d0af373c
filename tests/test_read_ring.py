"""ReadRing: slots declared once, overflow counted instead of blocking, buffers always returned."""

from __future__ import annotations

import threading

import pytest
import torch

from kvtier.errors import PinnedBudgetExceeded, StoreClosed
from kvtier.layout import KVLayout
from kvtier.memory import HostPool, PinnedBudget, ReadRing
from kvtier.memory.host_bytes import HOST_ALIGN_BYTES
from kvtier.store.memory import MemoryStore

PAGE = 5000


@pytest.fixture
def budget() -> PinnedBudget:
    return PinnedBudget(1 << 20)


def test_ring_declares_its_slots_to_the_budget_once(budget):
    ring = ReadRing(3, PAGE, budget)
    assert ring.slot_stride % HOST_ALIGN_BYTES == 0 and ring.slot_stride >= PAGE
    assert budget.stats()["owners"]["read_ring"]["bytes"] == 3 * ring.slot_stride
    for _ in range(10):
        with ring.borrow():
            pass
    assert budget.held_bytes == ring.nbytes
    assert budget.stats()["owners"]["read_ring"]["leases"] == 1


def test_ring_over_budget_is_refused_before_allocation():
    budget = PinnedBudget(4096)
    with pytest.raises(PinnedBudgetExceeded) as info:
        ReadRing(2, PAGE, budget)
    assert info.value.owner == "read_ring" and budget.held_bytes == 0


def test_borrowed_slots_are_aligned_distinct_and_page_sized(budget):
    ring = ReadRing(3, PAGE, budget)
    with ring.borrow_many(3) as bufs:
        ptrs = [b.data_ptr() for b in bufs]
        assert all(p % HOST_ALIGN_BYTES == 0 for p in ptrs)
        assert len(set(ptrs)) == 3 and all(b.numel() == PAGE for b in bufs)
        assert ring.free_slots == 0
    assert ring.free_slots == 3


def test_exhausted_ring_overflows_without_blocking_and_counts_it(budget):
    ring = ReadRing(2, PAGE, budget)
    done = threading.Event()

    def borrow_three() -> None:
        with ring.borrow_many(3) as bufs:
            assert len(bufs) == 3
        done.set()

    worker = threading.Thread(target=borrow_three)
    worker.start()
    worker.join(timeout=10)
    assert done.is_set()
    stats = ring.stats()
    assert stats["overflow_total"] == 1 and stats["overflow_bytes_total"] == PAGE
    assert stats["overflow_in_use"] == 0 and stats["free_slots"] == 2
    assert budget.held_bytes == ring.nbytes  # overflow buffers are not pinned, not leased


def test_overflow_buffer_is_a_real_separate_buffer(budget):
    ring = ReadRing(1, PAGE, budget)
    slot = ring.acquire()
    extra = ring.acquire()
    assert not slot.overflow and extra.overflow
    extra.tensor.fill_(7)
    slot.tensor.fill_(1)
    assert int(extra.tensor.sum()) == 7 * PAGE
    extra.release()
    slot.release()
    assert ring.stats()["peak_in_use"] == 2


def test_raising_read_returns_its_buffer(budget):
    ring = ReadRing(2, PAGE, budget)
    with pytest.raises(OSError), ring.borrow():
        raise OSError("short read")
    with pytest.raises(OSError), ring.borrow_many(2):
        raise OSError("short read")
    assert ring.free_slots == 2 and ring.stats()["slots_in_use"] == 0


def test_release_is_idempotent(budget):
    ring = ReadRing(2, PAGE, budget)
    held = ring.acquire()
    held.release()
    held.release()
    assert ring.free_slots == 2 and held.released


def test_partial_slice_borrow_is_a_prefix_of_a_slot(budget):
    ring = ReadRing(1, PAGE, budget)
    with ring.borrow(100) as buf:
        assert buf.numel() == 100
    with pytest.raises(ValueError):
        ring.acquire(PAGE + 1)
    assert ring.free_slots == 1


def test_closed_ring_refuses_borrows_and_returns_its_bytes(budget):
    ring = ReadRing(2, PAGE, budget)
    held = ring.acquire()
    ring.close()
    held.release()
    assert budget.held_bytes == 0 and ring.free_slots == 0
    with pytest.raises(StoreClosed):
        ring.acquire()


def test_concurrent_borrows_never_share_a_slot(budget):
    ring = ReadRing(4, PAGE, budget)
    errors: list[str] = []

    def worker(tag: int) -> None:
        for _ in range(200):
            with ring.borrow() as buf:
                buf.fill_(tag)
                if int(buf.min()) != tag or int(buf.max()) != tag:
                    errors.append("shared")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(1, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and ring.free_slots == 4
    assert ring.stats()["borrowed_total"] == 6 * 200


def test_store_read_lands_in_a_ring_slot_then_in_a_layer_first_pool(budget):
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float16", page_size=4)
    store = MemoryStore(layout.page_bytes)
    page = torch.randint(0, 256, (layout.page_bytes,), dtype=torch.uint8)
    store.write([b"k" * 32], [page])
    pool = HostPool(layout, 2, budget, host_layout="layer_first")
    ring = ReadRing(1, layout.page_bytes, budget)
    with ring.borrow() as buf:
        assert store.read_into([b"k" * 32], [buf]) == [True]
        pool.copy_page_in(1, buf)
    out = torch.empty(layout.page_bytes, dtype=torch.uint8)
    pool.copy_page_out(1, out)
    assert torch.equal(out, page) and ring.free_slots == 1
