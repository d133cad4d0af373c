"""Batch checks before any copy, and the pool geometry the kernels address by."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.errors import LayoutMismatch
from kvtier.layout import KVLayout
from kvtier.transfer import CopyEngine
from kvtier.transfer.plan import device_geometry, host_geometry, layer_range, make_plan
from transfer_support import make_pools, snapshot

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype="float16", page_size=2)


@pytest.fixture
def engine_and_pools():
    dev, host = make_pools(LAYOUT, 4, 5, "page_first", seed=2)
    return CopyEngine(dev, host), dev, host


@pytest.mark.parametrize(("host_ids", "device_ids"), [
    ([0, 5], [0, 1]),    # host id past the end
    ([0, -1], [0, 1]),   # negative host id
    ([0, 1], [4, 1]),    # device id past the end
])
def test_out_of_range_page_id_is_an_error_and_writes_nothing(engine_and_pools, host_ids,
                                                            device_ids) -> None:
    engine, dev, host = engine_and_pools
    before = snapshot(dev, host)
    with pytest.raises(IndexError, match="outside"):
        engine.load(host_ids, device_ids)
    with pytest.raises(IndexError, match="outside"):
        engine.store(device_ids, host_ids)
    after = snapshot(dev, host)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_repeated_destination_is_refused_but_repeated_source_is_fine(engine_and_pools) -> None:
    engine, dev, host = engine_and_pools
    with pytest.raises(ValueError, match="more than once"):
        engine.load([0, 1], [2, 2])
    assert engine.load([3, 3], [0, 1]).wait(0)
    as_bytes = dev.kv.view(torch.uint8)
    assert torch.equal(as_bytes[:, :, 0], as_bytes[:, :, 1])


def test_mismatched_id_counts_and_non_integer_ids_are_refused(engine_and_pools) -> None:
    engine, _, _ = engine_and_pools
    with pytest.raises(ValueError, match="destination ids"):
        engine.load([0, 1, 2], [0, 1])
    with pytest.raises(ValueError, match="integers"):
        engine.load([0.0, 1.0], [0, 1])
    with pytest.raises(ValueError, match="1-D"):
        engine.load([[0, 1]], [[0, 1]])


def test_layer_selection_must_be_a_contiguous_range_inside_the_model() -> None:
    assert layer_range(None, 4) == (0, 4)
    assert layer_range(2, 4) == (2, 1)
    assert layer_range(range(1, 3), 4) == (1, 2)
    assert layer_range([1, 2, 3], 4) == (1, 3)
    with pytest.raises(ValueError, match="contiguous"):
        layer_range([0, 2], 4)
    with pytest.raises(IndexError):
        layer_range(range(3, 5), 4)
    with pytest.raises(ValueError, match="empty"):
        layer_range([], 4)


def test_pools_of_different_layouts_are_a_layout_mismatch() -> None:
    other = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype="float16", page_size=4)
    with pytest.raises(LayoutMismatch):
        make_plan("load", host_geometry(other, 2, "page_first"), device_geometry(LAYOUT, 2),
                  [0], [0])
    dev, _ = make_pools(LAYOUT, 2, 2, "page_first")
    _, host = make_pools(other, 2, 2, "page_first")
    with pytest.raises(LayoutMismatch):
        CopyEngine(dev, host)


def test_ids_may_be_numpy_arrays_or_cpu_tensors() -> None:
    dg, hg = device_geometry(LAYOUT, 4), host_geometry(LAYOUT, 4, "page_first")
    plan = make_plan("load", hg, dg, np.array([1, 2], dtype=np.int32), torch.tensor([3, 0]))
    assert plan.src_ids.dtype == np.int64 and list(plan.dst_ids) == [3, 0]
    assert plan.nbytes == 2 * LAYOUT.page_bytes
    assert make_plan("store", dg, hg, [], []).num_pages == 0


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_host_geometry_agrees_with_the_host_pool_addressing(host_layout: str) -> None:
    _, host = make_pools(LAYOUT, 1, 3, host_layout)
    geo = host_geometry(LAYOUT, 3, host_layout)
    for page in range(3):
        for layer in range(LAYOUT.num_layers):
            for part in range(LAYOUT.parts):
                assert geo.part_offset(page, layer, part) == host.part_offset(page, layer, part)
    assert geo.nbytes == host.nbytes


def test_device_geometry_agrees_with_the_device_tensor_layout() -> None:
    dev, _ = make_pools(LAYOUT, 3, 1, "page_first")
    geo = device_geometry(LAYOUT, 3)
    base = dev.kv.data_ptr()
    for page in range(3):
        for layer in range(LAYOUT.num_layers):
            for part in range(LAYOUT.parts):
                assert dev.kv[layer, part, page].data_ptr() - base == geo.part_offset(
                    page, layer, part)
    assert geo.nbytes == dev.nbytes
