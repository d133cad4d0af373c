"""Pinned-memory behaviour with a real CUDA driver (skipped without a GPU).

torch's ``Tensor.is_pinned()`` answers False for memory pinned with ``cudaHostRegister`` (torch
2.11 asks its own allocator), so these tests ask the driver: unregistering succeeds only for a
registered range, registering succeeds only for one that is not.
"""

from __future__ import annotations

import gc

import pytest
import torch

from kvtier.layout import KVLayout
from kvtier.memory import HostPool, PinnedBudget, ReadRing, allocate_host_bytes
from kvtier.memory import host_bytes as host_bytes_mod
from kvtier.memory.host_bytes import HOST_ALIGN_BYTES

pytestmark = pytest.mark.gpu

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", page_size=16)


def driver_says_registered(ptr: int, nbytes: int) -> bool:
    """Unregister then re-register ``ptr``: succeeds (True) only if it was registered."""
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(ptr, nbytes, 0)) == 0:  # it was not registered
        assert int(cudart.cudaHostUnregister(ptr)) == 0
        return False
    host_bytes_mod._clear_cuda_error()
    return True


def test_host_bytes_are_registered_and_exact():
    budget = PinnedBudget(1 << 30)
    host = allocate_host_bytes(budget, "probe", 3 * 1000 * 1000)
    assert host.method == "registered" and host.pinned
    assert host.tensor.data_ptr() % HOST_ALIGN_BYTES == 0
    assert budget.held_bytes == 3 * 1000 * 1000
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostUnregister(host.tensor.data_ptr())) == 0  # it was registered
    assert int(cudart.cudaHostRegister(host.tensor.data_ptr(), host.nbytes, 0)) == 0
    host.close()
    assert budget.held_bytes == 0


def test_closing_unpins_the_memory():
    budget = PinnedBudget(1 << 30)
    host = allocate_host_bytes(budget, "probe", 1 << 20)
    kept = host.tensor
    host.close()
    assert not driver_says_registered(kept.data_ptr(), 1 << 20)


def test_dropped_pools_leave_no_registration_behind():
    budget = PinnedBudget(1 << 30)
    for _ in range(5):
        HostPool(LAYOUT, 64, budget)  # never closed
    gc.collect()
    assert budget.held_bytes == 0
    with HostPool(LAYOUT, 64, budget) as pool:
        assert pool.pin_method == "registered"
    torch.zeros(1, device="cuda").add_(1)
    torch.cuda.synchronize()


def test_refused_registration_falls_back_without_poisoning_cuda(monkeypatch):
    real = host_bytes_mod._register
    taken: list[int] = []

    def collide(ptr: int, nbytes: int) -> bool:
        assert real(ptr, nbytes)  # someone else registered the range first
        taken.append(ptr)
        return real(ptr, nbytes)  # so ours is refused by the driver

    kept: list = []  # the collided buffer stays alive until its registration is removed
    real_empty = host_bytes_mod.aligned_empty
    monkeypatch.setattr(host_bytes_mod, "aligned_empty",
                        lambda n: kept.append(real_empty(n)) or kept[-1])
    monkeypatch.setattr(host_bytes_mod, "_register", collide)
    budget = PinnedBudget(1 << 30)
    host = allocate_host_bytes(budget, "ring", 5000)
    assert host.method == "torch_pinned" and host.tensor.is_pinned()
    assert budget.held_bytes == host.leased_bytes >= 5000 + HOST_ALIGN_BYTES
    torch.zeros(1, device="cuda").add_(1)  # the refused call's error was consumed
    torch.cuda.synchronize()
    host.close()
    host_bytes_mod._unregister(taken[0])
    assert budget.held_bytes == 0


def test_pin_false_gives_pageable_memory_on_a_cuda_machine():
    budget = PinnedBudget(1 << 20)
    with allocate_host_bytes(budget, "pool", 4096, pin=False) as host:
        assert host.method == "pageable" and not host.tensor.is_pinned()


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_host_pool_is_pinned_and_round_trips_through_the_device(host_layout):
    budget = PinnedBudget(1 << 30)
    with HostPool(LAYOUT, 8, budget, host_layout=host_layout) as pool:
        assert pool.pinned and pool.pin_method == "registered"
        page = torch.randint(0, 256, (LAYOUT.page_bytes,), dtype=torch.uint8)
        pool.copy_page_in(3, page)
        device = pool.buffer.to("cuda", non_blocking=True)
        back = torch.empty_like(pool.buffer)
        back.copy_(device, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(back, pool.buffer)
    assert budget.held_bytes == 0


def test_read_ring_slots_are_pinned():
    budget = PinnedBudget(1 << 30)
    with ReadRing(4, LAYOUT.page_bytes, budget) as ring:
        assert ring.pinned
        with ring.borrow() as buf:
            assert buf.data_ptr() % HOST_ALIGN_BYTES == 0
    assert budget.held_bytes == 0


def test_three_pool_lifetimes_leave_torch_pinned_cache_untouched():
    budget = PinnedBudget(1 << 30)
    before = torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0)
    for _ in range(3):
        pool = HostPool(LAYOUT, 256, budget)
        ring = ReadRing(8, LAYOUT.page_bytes, budget)
        assert budget.held_bytes == pool.nbytes + ring.nbytes
        ring.close()
        pool.close()
        assert budget.held_bytes == 0
    after = torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0)
    assert after == before
