"""The copy engine on the CPU (synchronous reference, or interpreted kernels) and its tickets."""

from __future__ import annotations

import os
import time

import pytest
import torch

from kvtier.layout import KVLayout
from kvtier.transfer import CopyEngine, Ticket
from transfer_support import make_pools, part_by_part, snapshot

LAYOUT = KVLayout(num_layers=3, num_kv_heads=1, head_dim=4, dtype="bfloat16", page_size=3)


@pytest.mark.parametrize("use_kernels", [False, True], ids=["reference", "triton"])
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_load_and_store_move_the_named_pages(use_kernels: bool, host_layout: str) -> None:
    if use_kernels and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("kernels over CPU pools run only interpreted; test_transfer_gpu covers CUDA")
    dev, host = make_pools(LAYOUT, 4, 5, host_layout, seed=7)
    want_dev, want_host = make_pools(LAYOUT, 4, 5, host_layout, seed=7)
    engine = CopyEngine(dev, host, use_kernels=use_kernels)
    load = engine.load([4, 0], [1, 3])
    store = engine.store([2, 1], [0, 3], layers=range(1, 3))
    assert load.is_done() and store.is_done() and load.wait(0) and store.wait(0)
    part_by_part("load", want_dev, want_host, [4, 0], [1, 3], range(3))
    part_by_part("store", want_dev, want_host, [2, 1], [0, 3], range(1, 3))
    got, want = snapshot(dev, host), snapshot(want_dev, want_host)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_layerwise_load_fills_each_layer_and_reports_it_done() -> None:
    dev, host = make_pools(LAYOUT, 2, 2, "layer_first", seed=9)
    want_dev, want_host = make_pools(LAYOUT, 2, 2, "layer_first", seed=9)
    ticket = CopyEngine(dev, host).load_layerwise([1], [0], layers=range(1, 3))
    assert ticket.layer_done(1) and ticket.wait_layer(2, 0) and ticket.wait(0)
    part_by_part("load", want_dev, want_host, [1], [0], range(1, 3))
    assert torch.equal(dev.kv.view(torch.uint8), want_dev.kv.view(torch.uint8))


def test_empty_batch_is_a_done_ticket_that_moves_nothing() -> None:
    dev, host = make_pools(LAYOUT, 2, 2, "page_first")
    before = snapshot(dev, host)
    ticket = CopyEngine(dev, host).load([], [])
    assert ticket.is_done() and ticket.num_pages == 0 and ticket.nbytes == 0
    after = snapshot(dev, host)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_stats_count_batches_pages_and_bytes_per_direction() -> None:
    dev, host = make_pools(LAYOUT, 4, 4, "page_first")
    engine = CopyEngine(dev, host)
    engine.load([0, 1], [2, 3])
    engine.store([0], [3], layers=0)
    stats = engine.stats()
    assert stats["path"] == "torch_reference"
    assert (stats["load_batches"], stats["load_pages"]) == (1, 2)
    assert stats["load_bytes"] == 2 * LAYOUT.page_bytes
    assert stats["store_bytes"] == LAYOUT.layer_bytes


class _FakeEvent:
    """Stands in for a CUDA event: done after ``ready_after`` queries (never if None)."""

    def __init__(self, ready_after: int | None) -> None:
        self.ready_after = ready_after
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.ready_after is not None and self.queries > self.ready_after


class _FakeStream:
    def __init__(self) -> None:
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


def test_wait_returns_true_once_the_copy_lands() -> None:
    event = _FakeEvent(ready_after=5)
    ticket = Ticket("load", 1, 10, [event])
    assert not ticket.is_done()
    assert ticket.wait(timeout=5.0)
    assert event.queries > 5


def test_wait_times_out_as_a_value_without_blocking_longer() -> None:
    ticket = Ticket("store", 1, 10, [_FakeEvent(ready_after=None)])
    start = time.monotonic()
    assert ticket.wait(timeout=0.02) is False
    assert time.monotonic() - start < 0.5
    assert not ticket.is_done()


def test_per_layer_ticket_answers_for_each_layer_and_orders_streams() -> None:
    events = [_FakeEvent(0), _FakeEvent(None)]
    ticket = Ticket("load", 1, 10, events, layer0=4)
    assert ticket.layer_done(4) and not ticket.layer_done(5)
    assert not ticket.is_done()
    stream = _FakeStream()
    ticket.stream_wait(stream, layer=5)
    ticket.stream_wait(stream)
    assert stream.waited == [events[1], events[1]]
    with pytest.raises(IndexError):
        ticket.layer_done(6)
