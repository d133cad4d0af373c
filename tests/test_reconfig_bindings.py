"""Generation-stamped bindings: readers left behind are caught, failed swaps disable the slot."""

from __future__ import annotations

import pytest

from kvtier.admin.bindings import (
    ABSENT,
    BindingIncoherent,
    BindingTable,
    Later,
    Reader,
    SwapFailed,
    check_host_shape,
)
from kvtier.errors import LayoutMismatch
from kvtier.layout import KVLayout


class Holder:
    """A component that keeps its own reference to a resource (like a copy engine does)."""

    def __init__(self, resource: object) -> None:
        self.resource = resource


def table_with_two_readers(first: object) -> tuple[BindingTable, Holder, Holder]:
    table = BindingTable()
    table.bind("store.disk", first)
    controller, workers = Holder(first), Holder(first)
    table.register(Reader("controller", "store.disk", lambda: controller.resource))
    table.register(Reader("io_workers", "store.disk", lambda: workers.resource))
    return table, controller, workers


def test_reader_left_behind_after_a_swap_is_caught_with_both_generations() -> None:
    old, new = object(), object()
    table, controller, _workers = table_with_two_readers(old)
    assert table.check() == []
    with pytest.raises(SwapFailed, match="io_workers holds store.disk generation 1"):
        table.swap("store.disk", new, [lambda: setattr(controller, "resource", new)],
                   disable=lambda: setattr(controller, "resource", None))
    binding = table.current("store.disk")
    assert binding.resource is None and "io_workers" in binding.disabled
    assert table.stats()["slots"]["store.disk"]["failures"] == 1
    assert table.incoherent_total >= 1


def test_swap_that_moves_every_reader_is_coherent_and_counted() -> None:
    old, new = object(), object()
    table, controller, workers = table_with_two_readers(old)
    steps = [lambda: setattr(controller, "resource", new), lambda: setattr(workers, "resource", new)]
    binding = table.swap("store.disk", new, steps, disable=lambda: None, detail="memory://b")
    assert binding.generation == 2 and binding.resource is new
    table.assert_coherent()
    assert table.stats()["slots"]["store.disk"] == {
        "generation": 2, "bound": True, "detail": "memory://b", "disabled": "", "swaps": 1,
        "failures": 0}


def test_planted_stale_reader_names_the_generation_it_still_holds() -> None:
    first, second, third = object(), object(), object()
    table, controller, workers = table_with_two_readers(first)
    stale = Holder(first)
    table.register(Reader("engine", "store.disk", lambda: stale.resource))
    for new in (second, third):
        controller.resource = workers.resource = new
        table.bind("store.disk", new)
    with pytest.raises(BindingIncoherent) as caught:
        table.assert_coherent()
    (lag,) = caught.value.lags
    assert (lag.reader, lag.held_generation, lag.current_generation) == ("engine", 1, 3)
    stale.resource = object()  # something no binding ever had
    assert table.check()[0].held_generation is None


def test_a_step_that_raises_leaves_the_slot_disabled_not_half_bound() -> None:
    old, new = object(), object()
    table, controller, workers = table_with_two_readers(old)

    def broken() -> None:
        raise OSError("disk vanished")

    def disable() -> None:
        controller.resource = workers.resource = None

    with pytest.raises(SwapFailed, match="disk vanished"):
        table.swap("store.disk", new, [lambda: setattr(controller, "resource", new), broken],
                   disable)
    assert controller.resource is None and workers.resource is None
    assert table.current("store.disk").disabled.startswith("OSError")
    table.assert_coherent()  # disabled, but every reader agrees


def test_absent_readers_and_facets_are_compared_as_declared() -> None:
    pool = Holder("allocator-1")
    table = BindingTable()
    table.bind("host_pool", pool, facets={"allocator": pool.resource})
    index = Holder(pool.resource)
    workers = None
    table.register(Reader("index", "host_pool", lambda: index.resource, "allocator"))
    table.register(Reader("io_workers", "host_pool", lambda: ABSENT if workers is None else workers))
    assert table.check() == []
    index.resource = "allocator-0"
    assert [lag.reader for lag in table.check()] == ["index"]


def test_later_target_is_resolved_after_the_steps_that_build_it() -> None:
    table = BindingTable()
    table.bind("host_pool", None)
    box: dict[str, object] = {}
    holder = Holder(None)
    table.register(Reader("controller", "host_pool", lambda: holder.resource))

    def build() -> None:
        box["pool"] = holder.resource = object()

    binding = table.swap("host_pool", Later(lambda: (box["pool"], {})), [build], lambda: None)
    assert binding.resource is box["pool"]


def test_host_pool_of_another_shape_is_refused_with_each_difference() -> None:
    device = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", page_size=4)
    host = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4)
    with pytest.raises(LayoutMismatch, match="num_layers 3 != 2, head_dim 8 != 4"):
        check_host_shape(_Pool(host), _Pool(device))
    check_host_shape(_Pool(device), _Pool(device))


class _Pool:
    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
