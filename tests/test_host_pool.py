"""HostPool: the two byte layouts of docs/architecture.md, canonical copies, budget leases."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import ConfigError, LayoutMismatch, PinnedBudgetExceeded, StoreClosed
from kvtier.layout import KVLayout
from kvtier.memory import HostPool, PinnedBudget, host_bytes

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype="float16", page_size=4)
MLA = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="bfloat16", page_size=4, mla=True)


def canonical_page(layout: KVLayout, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (layout.page_bytes,), dtype=torch.uint8, generator=gen)


@pytest.fixture
def budget() -> PinnedBudget:
    return PinnedBudget(1 << 20)


def test_page_first_page_is_the_contract_slice(budget):
    pool = HostPool(LAYOUT, 5, budget)
    pb = LAYOUT.page_bytes
    assert pool.buffer.numel() == 5 * pb and pool.buffer.dtype == torch.uint8
    assert pool.shaped().shape == (5, pb)
    assert pool.page(3).data_ptr() == pool.buffer.data_ptr() + 3 * pb
    assert pool.page(3).numel() == pb


@pytest.mark.parametrize("layout", [LAYOUT, MLA])
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_part_offsets_follow_the_layout_contract(budget, layout, host_layout):
    pool = HostPool(layout, 4, budget, host_layout=host_layout)
    for h in range(4):
        for layer in range(layout.num_layers):
            for part in range(layout.parts):
                if host_layout == "page_first":
                    want = h * layout.page_bytes + (layer * layout.parts + part) * layout.part_bytes
                else:
                    want = (layer * 4 + h) * layout.layer_bytes + part * layout.part_bytes
                assert pool.part_offset(h, layer, part) == want
                assert pool.part(h, layer, part).data_ptr() == pool.buffer.data_ptr() + want


@pytest.mark.parametrize("layout", [LAYOUT, MLA])
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_copy_page_round_trips_canonical_bytes(budget, layout, host_layout):
    pool = HostPool(layout, 4, budget, host_layout=host_layout)
    pages = {h: canonical_page(layout, h) for h in range(4)}
    for h, data in pages.items():
        pool.copy_page_in(h, data)
    for h, data in pages.items():
        out = torch.empty(layout.page_bytes, dtype=torch.uint8)
        pool.copy_page_out(h, out)
        assert torch.equal(out, data)


def test_layer_first_places_each_layer_where_the_contract_says(budget):
    pool = HostPool(LAYOUT, 4, budget, host_layout="layer_first")
    data = canonical_page(LAYOUT, 7)
    pool.copy_page_in(2, data)
    for layer in range(LAYOUT.num_layers):
        for part in range(LAYOUT.parts):
            src = (layer * LAYOUT.parts + part) * LAYOUT.part_bytes
            assert torch.equal(pool.part(2, layer, part), data[src:src + LAYOUT.part_bytes])
    assert pool.shaped().shape == (LAYOUT.num_layers, 4, LAYOUT.layer_bytes)


def test_layer_first_pool_has_no_contiguous_page_view(budget):
    pool = HostPool(LAYOUT, 2, budget, host_layout="layer_first")
    with pytest.raises(LayoutMismatch):
        pool.page(0)


def test_copies_refuse_wrong_sized_or_typed_buffers(budget):
    pool = HostPool(LAYOUT, 2, budget)
    with pytest.raises(LayoutMismatch):
        pool.copy_page_in(0, torch.zeros(LAYOUT.page_bytes - 1, dtype=torch.uint8))
    with pytest.raises(LayoutMismatch):
        pool.copy_page_out(0, torch.zeros(LAYOUT.page_bytes // 2, dtype=torch.float16))


def test_page_ids_outside_the_pool_raise(budget):
    pool = HostPool(LAYOUT, 2, budget)
    with pytest.raises(IndexError):
        pool.page(2)
    with pytest.raises(IndexError):
        pool.part(0, LAYOUT.num_layers, 0)


def test_pool_bytes_are_reserved_before_allocation(monkeypatch):
    calls: list[int] = []
    real = host_bytes.aligned_empty
    monkeypatch.setattr(host_bytes, "aligned_empty", lambda n: calls.append(n) or real(n))
    budget = PinnedBudget(LAYOUT.page_bytes * 3)
    with pytest.raises(PinnedBudgetExceeded) as info:
        HostPool(LAYOUT, 4, budget)
    assert info.value.owner == "host_pool" and info.value.asked == 4 * LAYOUT.page_bytes
    assert calls == [] and budget.held_bytes == 0


def test_close_returns_the_bytes_and_blocks_further_use(budget):
    pool = HostPool(LAYOUT, 4, budget)
    assert budget.stats()["owners"]["host_pool"]["bytes"] == 4 * LAYOUT.page_bytes
    pool.close()
    pool.close()
    assert budget.held_bytes == 0 and pool.closed
    with pytest.raises(StoreClosed):
        pool.page(0)


def test_from_bytes_takes_whole_pages(budget):
    pool = HostPool.from_bytes(LAYOUT, LAYOUT.page_bytes * 5 + 7, budget)
    assert pool.num_pages == 5 and budget.held_bytes == 5 * LAYOUT.page_bytes


def test_unknown_host_layout_is_a_config_error(budget):
    with pytest.raises(ConfigError):
        HostPool(LAYOUT, 2, budget, host_layout="head_first")


def test_stats_report_allocator_state(budget):
    pool = HostPool(LAYOUT, 4, budget)
    pool.allocator.allocate(3)
    stats = pool.stats()
    assert (stats["free"], stats["used"], stats["bytes"]) == (1, 3, 4 * LAYOUT.page_bytes)
    assert stats["pin_method"] in ("pageable", "registered", "torch_pinned")
