"""PinnedBudget and allocate_host_bytes: refusals before allocation, leases, per-owner stats."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from kvtier.errors import CapacityError, ConfigError, PinnedBudgetExceeded
from kvtier.memory import host_bytes
from kvtier.memory.host_bytes import HOST_ALIGN_BYTES, allocate_host_bytes
from kvtier.memory.pinned import PinnedBudget


def test_reservation_over_limit_is_refused_naming_owner_and_numbers():
    budget = PinnedBudget(1000)
    budget.reserve("host_pool", 700)
    with pytest.raises(PinnedBudgetExceeded) as info:
        budget.reserve("read_ring", 400)
    err = info.value
    assert (err.owner, err.asked, err.held, err.allowed) == ("read_ring", 400, 700, 1000)
    assert "read_ring" in str(err) and "400" in str(err) and "700" in str(err)
    assert budget.held_bytes == 700
    assert budget.stats()["owners"]["read_ring"] == {"bytes": 0, "leases": 0, "peak_bytes": 0,
                                                    "refused": 1}


def test_reservation_exactly_at_limit_is_granted():
    budget = PinnedBudget(1000)
    budget.reserve("a", 600)
    budget.reserve("b", 400)
    assert budget.available_bytes == 0
    assert not budget.can_reserve(1)


def test_lease_release_returns_bytes_once():
    budget = PinnedBudget(1000)
    lease = budget.reserve("a", 600)
    lease.release()
    lease.release()
    assert lease.released
    assert budget.held_bytes == 0
    assert budget.stats()["owners"]["a"]["leases"] == 0


def test_lease_context_manager_releases_on_error():
    budget = PinnedBudget(100)
    with pytest.raises(RuntimeError), budget.reserve("staging", 60):
        assert budget.held_bytes == 60
        raise RuntimeError("boom")
    assert budget.held_bytes == 0


def test_stats_break_down_bytes_by_owner():
    budget = PinnedBudget(10_000)
    budget.reserve("host_pool", 4000)
    budget.reserve("read_ring", 1000)
    budget.reserve("read_ring", 500)
    stats = budget.stats()
    assert stats["held_bytes"] == 5500 and stats["available_bytes"] == 4500
    assert stats["owners"]["host_pool"]["bytes"] == 4000
    assert stats["owners"]["read_ring"] == {"bytes": 1500, "leases": 2, "peak_bytes": 1500,
                                           "refused": 0}


@pytest.mark.parametrize("owner, nbytes", [("", 1), ("a", -1), ("a", 1.5), ("a", True)])
def test_reserve_rejects_bad_arguments(owner, nbytes):
    with pytest.raises(ValueError):
        PinnedBudget(10).reserve(owner, nbytes)


def test_budget_limit_must_be_a_non_negative_integer():
    with pytest.raises(ConfigError):
        PinnedBudget(-1)


def test_concurrent_reservations_never_pass_the_limit():
    budget = PinnedBudget(64 * 100)
    peaks: list[int] = []

    def worker() -> None:
        for _ in range(300):
            try:
                lease = budget.reserve("w", 100)
            except PinnedBudgetExceeded:
                continue
            peaks.append(budget.held_bytes)
            lease.release()

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert budget.held_bytes == 0
    assert budget.stats()["peak_bytes"] <= budget.limit_bytes
    assert max(peaks) <= budget.limit_bytes


def test_refused_allocation_allocates_nothing(monkeypatch):
    calls: list[int] = []
    real = host_bytes.aligned_empty
    monkeypatch.setattr(host_bytes, "aligned_empty", lambda n: calls.append(n) or real(n))
    budget = PinnedBudget(4096)
    with pytest.raises(PinnedBudgetExceeded):
        allocate_host_bytes(budget, "host_pool", 8192, pin=False)
    assert calls == []
    assert budget.held_bytes == 0


def test_failed_allocation_releases_its_lease(monkeypatch):
    def fail(n: int):
        raise MemoryError("no memory")

    monkeypatch.setattr(host_bytes, "aligned_empty", fail)
    budget = PinnedBudget(1 << 20)
    with pytest.raises(MemoryError):
        allocate_host_bytes(budget, "host_pool", 4096, pin=False)
    assert budget.held_bytes == 0


def test_host_bytes_are_aligned_and_closing_returns_the_lease():
    budget = PinnedBudget(1 << 20)
    host = allocate_host_bytes(budget, "ring", 10_000, pin=False)
    assert host.tensor.numel() == 10_000 and host.tensor.dtype == torch.uint8
    assert host.tensor.data_ptr() % HOST_ALIGN_BYTES == 0
    assert budget.held_bytes == 10_000 and host.method == "pageable"
    host.close()
    host.close()
    assert host.closed and host.tensor is None and budget.held_bytes == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_pinning_without_cuda_is_a_config_error():
    budget = PinnedBudget(1 << 20)
    with pytest.raises(ConfigError):
        allocate_host_bytes(budget, "pool", 4096, pin=True)
    assert budget.held_bytes == 0
    assert allocate_host_bytes(budget, "pool", 4096).method == "pageable"


def test_capacity_errors_are_memory_errors():
    assert issubclass(PinnedBudgetExceeded, CapacityError)
    assert issubclass(PinnedBudgetExceeded, MemoryError)


# ---- pinning paths, with the CUDA calls replaced by recorders -----------------------------------


@pytest.fixture
def fake_cuda(monkeypatch):
    calls: dict[str, list] = {"register": [], "unregister": [], "cleared": [], "emptied": []}
    monkeypatch.setattr(host_bytes, "cuda_present", lambda: True)
    monkeypatch.setattr(host_bytes, "_register",
                        lambda ptr, n: calls["register"].append((ptr, n)) or True)
    monkeypatch.setattr(host_bytes, "_unregister", lambda ptr: calls["unregister"].append(ptr))
    monkeypatch.setattr(host_bytes, "_clear_cuda_error", lambda: calls["cleared"].append(1))
    monkeypatch.setattr(host_bytes, "_empty_torch_host_cache", lambda: calls["emptied"].append(1))
    monkeypatch.setattr(host_bytes, "_torch_pinned", lambda n: torch.empty(n, dtype=torch.uint8))
    return calls


def test_registered_buffer_is_unregistered_once_on_close(fake_cuda):
    budget = PinnedBudget(1 << 20)
    host = allocate_host_bytes(budget, "pool", 8192)
    ptr = host.tensor.data_ptr()
    assert host.method == "registered" and host.pinned
    assert fake_cuda["register"] == [(ptr, 8192)]
    host.close()
    host.close()
    del host
    gc.collect()
    assert fake_cuda["unregister"] == [ptr] and budget.held_bytes == 0


def test_buffer_dropped_without_close_is_unregistered_and_released(fake_cuda):
    budget = PinnedBudget(1 << 20)
    host = allocate_host_bytes(budget, "pool", 8192)
    ptr = host.tensor.data_ptr()
    del host
    gc.collect()
    assert fake_cuda["unregister"] == [ptr]
    assert budget.held_bytes == 0


def test_refused_registration_falls_back_and_leases_the_rounded_size(monkeypatch, fake_cuda):
    monkeypatch.setattr(host_bytes, "_register", lambda ptr, n: False)
    budget = PinnedBudget(1 << 20)
    host = allocate_host_bytes(budget, "ring", 5000)
    assert host.method == "torch_pinned" and fake_cuda["cleared"] == [1]
    assert host.tensor.numel() == 5000 and host.tensor.data_ptr() % HOST_ALIGN_BYTES == 0
    assert budget.held_bytes == host.leased_bytes == 16384  # next power of two of 5000 + 4096
    host.close()
    assert budget.held_bytes == 0 and fake_cuda["emptied"] == [1]
    assert fake_cuda["unregister"] == []


def test_fallback_whose_rounding_passes_the_budget_is_refused(monkeypatch, fake_cuda):
    monkeypatch.setattr(host_bytes, "_register", lambda ptr, n: False)
    budget = PinnedBudget(10_000)
    with pytest.raises(PinnedBudgetExceeded) as info:
        allocate_host_bytes(budget, "ring", 5000)
    assert info.value.asked == 16384 - 5000
    assert budget.held_bytes == 0


def test_pool_dropped_without_close_returns_its_bytes():
    from kvtier.layout import KVLayout
    from kvtier.memory import HostPool

    budget = PinnedBudget(1 << 20)
    pool = HostPool(KVLayout(2, 1, 8, "float16", 4), 4, budget)
    assert budget.held_bytes > 0
    del pool
    gc.collect()
    assert budget.held_bytes == 0


def test_buffer_helpers_live_in_host_bytes_only():
    from kvtier.memory import host_bytes, pinned

    assert host_bytes.allocate_host_bytes is allocate_host_bytes
    assert host_bytes.HOST_ALIGN_BYTES == HOST_ALIGN_BYTES
    assert not hasattr(pinned, "allocate_host_bytes") and not hasattr(pinned, "HostBytes")
