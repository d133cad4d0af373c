"""PageAllocator: all-or-nothing allocation, safe frees, integrity, and a model-based check."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.errors import PoolExhausted
from kvtier.memory.allocator import PageAllocator


def test_allocation_hands_out_distinct_ids_in_order():
    pool = PageAllocator(8)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.num_free == 3 and pool.num_used == 5


def test_allocation_past_capacity_is_all_or_nothing():
    pool = PageAllocator(4)
    pool.allocate(3)
    assert not pool.can_allocate(2)
    with pytest.raises(PoolExhausted, match="asked for 2 pages, 1 of 4 free"):
        pool.allocate(2)
    assert pool.num_free == 1
    assert pool.stats()["refused_total"] == 1
    pool.check_integrity()


def test_freed_pages_are_reused_first():
    pool = PageAllocator(8)
    ids = pool.allocate(4)
    pool.free([ids[1]])
    assert pool.allocate(1) == [ids[1]]


def test_double_free_raises_and_frees_nothing():
    pool = PageAllocator(4)
    ids = pool.allocate(3)
    pool.free([ids[0]])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([ids[1], ids[0]])
    assert pool.is_allocated(ids[1])
    assert pool.num_free == 2
    pool.check_integrity()


def test_duplicate_ids_in_one_free_are_refused():
    pool = PageAllocator(4)
    ids = pool.allocate(2)
    with pytest.raises(ValueError):
        pool.free([ids[0], ids[0]])
    assert pool.num_used == 2


@pytest.mark.parametrize("bad", [-1, 4, 1.0, None])
def test_freeing_ids_outside_the_pool_raises(bad):
    pool = PageAllocator(4)
    pool.allocate(4)
    with pytest.raises(ValueError):
        pool.free([bad])
    assert pool.num_free == 0


def test_zero_page_allocation_and_empty_pool():
    pool = PageAllocator(0)
    assert pool.allocate(0) == []
    with pytest.raises(PoolExhausted):
        pool.allocate(1)
    pool.check_integrity()


def test_check_integrity_detects_a_corrupted_free_list():
    pool = PageAllocator(4)
    pool.allocate(2)
    pool._free.append(0)  # page 0 is used: now it is both free and used
    with pytest.raises(AssertionError):
        pool.check_integrity()


class AllocatorMachine(RuleBasedStateMachine):
    """The allocator against a plain set of held ids."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = PageAllocator(16)
        self.held: set[int] = set()

    @rule(n=st.integers(0, 6))
    def allocate(self, n):
        if n > 16 - len(self.held):
            with pytest.raises(PoolExhausted):
                self.pool.allocate(n)
            return
        ids = self.pool.allocate(n)
        assert len(set(ids)) == n and not self.held & set(ids)
        self.held |= set(ids)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_some(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.held)), unique=True, min_size=1))
        self.pool.free(ids)
        self.held -= set(ids)

    @invariant()
    def conserved(self):
        self.pool.check_integrity()
        assert self.pool.num_used == len(self.held)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
