"""The copy-engine path (``path="copy_engine"``) on the CPU: the driver's batched copy stands in as
``memmove`` over host memory and the scatter/gather kernels run in the Triton interpreter, so the
addressing, the chunking through a staging buffer smaller than the batch, and whole-page versus
layer-by-layer copies are checked byte for byte against a part-by-part oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.layout import KVLayout
from kvtier.transfer import CopyEngine
from kvtier.transfer.ce_batch import host_memmove
from transfer_support import make_pools, part_by_part, snapshot

LAYOUT = KVLayout(3, 2, 16, "float32", 4)  # parts of 512 bytes, pages of 3 KiB


def _engine(dev, host, staging_pages: float = 2.5):
    batch = host_memmove()
    staging = int(staging_pages * LAYOUT.page_bytes)
    return CopyEngine(dev, host, path="copy_engine", staging_bytes=staging,
                      batch_copy=batch), batch


@pytest.mark.parametrize("direction", ["load", "store"])
@pytest.mark.parametrize("layers", [None, range(1, 3), 2])
def test_staged_copies_match_the_oracle(direction, layers):
    dev, host = make_pools(LAYOUT, 9, 11, "page_first", seed=3)
    want_dev, want_host = make_pools(LAYOUT, 9, 11, "page_first", seed=3)
    engine, batch = _engine(dev, host)
    src = [7, 0, 3, 10, 5, 2, 9] if direction == "load" else [8, 0, 4, 1, 6, 2, 3]
    dst = [1, 8, 4, 0, 6, 3, 2] if direction == "load" else [10, 3, 0, 7, 5, 9, 1]
    chosen = range(LAYOUT.num_layers) if layers is None else \
        (range(layers, layers + 1) if isinstance(layers, int) else layers)
    if direction == "load":
        ticket = engine.load(src, dst, layers=layers)
    else:
        ticket = engine.store(src, dst, layers=layers)
    assert ticket.wait(0)
    part_by_part(direction, want_dev, want_host, src, dst, chosen)
    got, want = snapshot(dev, host), snapshot(want_dev, want_host)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # 7 pages through a staging of 2.5 pages: 4 chunks of whole pages, or per layer one chunk
    # (a layer of a page is a third of it: 7 fit)
    assert batch.calls == (4 if layers is None else len(chosen))
    assert engine.stats()["path"] == "copy_engine"


def test_layerwise_load_through_staging_fills_every_layer():
    dev, host = make_pools(LAYOUT, 6, 6, "page_first", seed=5)
    want_dev, want_host = make_pools(LAYOUT, 6, 6, "page_first", seed=5)
    engine, _ = _engine(dev, host, staging_pages=1)
    ticket = engine.load_layerwise([5, 1, 2], [0, 4, 3])
    for layer in range(LAYOUT.num_layers):
        assert ticket.layer_done(layer)
    part_by_part("load", want_dev, want_host, [5, 1, 2], [0, 4, 3], range(LAYOUT.num_layers))
    assert torch.equal(snapshot(dev, host)[0], snapshot(want_dev, want_host)[0])


def test_layer_first_host_pools_fall_back_to_the_kernels_and_say_why():
    dev, host = make_pools(LAYOUT, 4, 4, "layer_first", seed=1)
    engine = CopyEngine(dev, host, path="copy_engine", batch_copy=host_memmove())
    assert engine.path == "kernel" and "page_first" in engine.stats()["path_fallback"]
    assert engine.staging_bytes == 0


def test_staging_must_hold_a_page_and_the_path_must_be_known():
    dev, host = make_pools(LAYOUT, 4, 4, "page_first")
    with pytest.raises(ValueError, match="holds no page"):
        CopyEngine(dev, host, path="copy_engine", staging_bytes=LAYOUT.page_bytes - 1,
                   batch_copy=host_memmove())
    with pytest.raises(ValueError, match="copy path"):
        CopyEngine(dev, host, path="dma")


def test_batch_copy_checks_its_arrays():
    batch = host_memmove()
    with pytest.raises(ValueError, match="sizes"):
        batch.copy(np.zeros(2, np.uint64), np.zeros(2, np.uint64), np.zeros(1, np.uint64), 0)


def test_consecutive_host_pages_cross_as_one_copy():
    dev, host = make_pools(LAYOUT, 9, 11, "page_first", seed=7)
    want_dev, want_host = make_pools(LAYOUT, 9, 11, "page_first", seed=7)
    engine, batch = _engine(dev, host, staging_pages=8)
    src, dst = [2, 3, 4, 5, 9, 0, 1], [1, 8, 4, 0, 6, 3, 2]
    engine.load(src, dst).wait(0)
    assert batch.calls == 1 and batch.copies == 3  # runs 2-5, 9, 0-1
    engine.store(dst, [6, 7, 8, 10, 2, 3, 4]).wait(0)
    assert batch.copies == 3 + 3  # runs 6-8, 10, 2-4
    part_by_part("load", want_dev, want_host, src, dst, range(LAYOUT.num_layers))
    part_by_part("store", want_dev, want_host, dst, [6, 7, 8, 10, 2, 3, 4],
                 range(LAYOUT.num_layers))
    got, want = snapshot(dev, host), snapshot(want_dev, want_host)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_merge_runs_keeps_copies_that_do_not_continue_each_other():
    from kvtier.transfer.staged import merge_runs

    dsts = np.array([0, 10, 20, 40], np.uint64)
    srcs = np.array([100, 110, 200, 210], np.uint64)
    sizes = np.full(4, 10, np.uint64)
    merged = merge_runs(dsts, srcs, sizes)
    assert [a.tolist() for a in merged] == [[0, 20, 40], [100, 200, 210], [20, 10, 10]]


def test_auto_sends_loads_through_the_copy_engines_and_stores_through_the_kernels():
    dev, host = make_pools(LAYOUT, 9, 11, "page_first", seed=9)
    want_dev, want_host = make_pools(LAYOUT, 9, 11, "page_first", seed=9)
    batch = host_memmove()
    engine = CopyEngine(dev, host, path="auto", staging_bytes=3 * LAYOUT.page_bytes,
                        batch_copy=batch)
    assert engine.path == "auto" and engine.staging_bytes == 3 * LAYOUT.page_bytes  # load only
    engine.store([5, 6], [9, 10]).wait(0)
    assert batch.calls == 0                       # by the kernels
    engine.load_layerwise([4, 8], [0, 1]).wait(0)
    assert batch.calls == LAYOUT.num_layers       # one copy-engine batch a layer
    engine.load([7, 2, 3], [2, 3, 4]).wait(0)
    assert batch.calls == LAYOUT.num_layers + 1   # one piece: one batch
    part_by_part("load", want_dev, want_host, [4, 8], [0, 1], range(LAYOUT.num_layers))
    part_by_part("store", want_dev, want_host, [5, 6], [9, 10], range(LAYOUT.num_layers))
    part_by_part("load", want_dev, want_host, [7, 2, 3], [2, 3, 4], range(LAYOUT.num_layers))
    got, want = snapshot(dev, host), snapshot(want_dev, want_host)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_auto_on_a_layer_first_pool_or_without_cuda_is_the_kernels():
    dev, host = make_pools(LAYOUT, 4, 4, "layer_first", seed=1)
    engine = CopyEngine(dev, host, path="auto", batch_copy=host_memmove())
    assert engine.path == "kernel" and "page_first" in engine.stats()["path_fallback"]
    dev, host = make_pools(LAYOUT, 4, 4, "page_first", seed=1)
    assert CopyEngine(dev, host).path == "kernel"         # the default, with no CUDA here
