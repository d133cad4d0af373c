"""The device page pool: one KV tensor in the documented shape, plus its allocator."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import ConfigError, LayoutMismatch, PoolExhausted
from kvtier.layout import KVLayout
from kvtier.memory.device_pool import DevicePool, pages_for_memory, torch_dtype

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=16)


def test_kv_tensor_has_the_documented_shape_dtype_and_zeroed_bytes() -> None:
    pool = DevicePool(LAYOUT, 5)
    assert pool.kv.shape == (4, 2, 5, 16, 2, 8)
    assert pool.kv.dtype == torch.bfloat16
    assert pool.nbytes == 5 * LAYOUT.page_bytes
    assert int(pool.kv.view(torch.uint8).max()) == 0


def test_one_part_of_one_page_is_contiguous_and_a_layer_is_one_view() -> None:
    pool = DevicePool(LAYOUT, 3)
    assert pool.kv[2, 1, 0].is_contiguous()
    assert pool.kv[2, 1, 0].numel() * 2 == LAYOUT.part_bytes
    assert pool.layer(2).data_ptr() == pool.kv[2].data_ptr()
    assert pool.keys(1).shape == (3, 16, 2, 8)
    pool.values(3)[2].fill_(1.5)
    assert float(pool.page(2)[3, 1].float().mean()) == 1.5
    assert pool.bytes_view().shape == (4, 2, 3, LAYOUT.part_bytes)


def test_allocator_hands_out_every_page_then_refuses() -> None:
    pool = DevicePool(LAYOUT, 3)
    assert sorted(pool.allocator.allocate(3)) == [0, 1, 2]
    with pytest.raises(PoolExhausted):
        pool.allocator.allocate(1)
    assert pool.stats()["used"] == 3


def test_mla_layout_has_one_part_and_no_values() -> None:
    mla = KVLayout(num_layers=2, num_kv_heads=1, head_dim=16, dtype="float8_e4m3fn", page_size=4,
                   mla=True)
    pool = DevicePool(mla, 2)
    assert pool.kv.shape == (2, 1, 2, 4, 1, 16) and pool.kv.dtype == torch.float8_e4m3fn
    with pytest.raises(LayoutMismatch):
        pool.values(0)


def test_bad_sizes_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        DevicePool(LAYOUT, 0)
    with pytest.raises(ConfigError):
        pages_for_memory(LAYOUT, 1 << 30, 0.0)
    with pytest.raises(IndexError):
        DevicePool(LAYOUT, 2).page(2)
    with pytest.raises(ConfigError):
        torch_dtype("no_such_dtype")


def test_pages_for_memory_takes_whole_pages_of_the_share() -> None:
    assert pages_for_memory(LAYOUT, 10 * LAYOUT.page_bytes, 0.5) == 5
    assert pages_for_memory(LAYOUT, 10 * LAYOUT.page_bytes - 1, 0.5) == 4
