"""The torch reference (CPU fallback and kernel oracle) against a part-by-part copy."""

from __future__ import annotations

import pytest
import torch

from kvtier.layout import KVLayout
from kvtier.transfer.plan import device_geometry, host_geometry, make_plan
from kvtier.transfer.reference import reference_copy
from transfer_support import make_pools, part_by_part, snapshot

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=3, dtype="bfloat16", page_size=5)
#: Parts of 80 bytes, which the reference moves as 8-byte words (LAYOUT's 60 go byte by byte).
WORD_LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype="bfloat16", page_size=5)


def _run_both(direction: str, host_layout: str, src: list[int], dst: list[int],
              layers: range | None, layout: KVLayout = LAYOUT) -> tuple[tuple, tuple, tuple]:
    dev, host = make_pools(layout, 6, 7, host_layout, seed=3)
    want_dev, want_host = make_pools(layout, 6, 7, host_layout, seed=3)
    before = snapshot(dev, host)
    dg, hg = device_geometry(layout, 6), host_geometry(layout, 7, host_layout)
    geos = (hg, dg) if direction == "load" else (dg, hg)
    plan = make_plan(direction, *geos, src, dst, layers)
    reference_copy(plan, dev.kv, host.buffer, host_layout)
    part_by_part(direction, want_dev, want_host, src, dst,
                 layers if layers is not None else range(layout.num_layers))
    return snapshot(dev, host), snapshot(want_dev, want_host), before


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("direction", ["load", "store"])
def test_reference_moving_whole_words_matches_part_by_part_copy(host_layout: str,
                                                                direction: str) -> None:
    got, want, before = _run_both(direction, host_layout, [1, 4, 5], [3, 2, 0], range(1, 3),
                                  WORD_LAYOUT)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not (torch.equal(got[0], before[0]) and torch.equal(got[1], before[1]))


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("layers", [None, range(1, 3), range(2, 3)])
def test_reference_load_matches_part_by_part_copy(host_layout: str, layers: range | None) -> None:
    got, want, before = _run_both("load", host_layout, [6, 0, 3], [2, 5, 0], layers)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not torch.equal(got[0], before[0])


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("layers", [None, range(0, 1)])
def test_reference_store_matches_part_by_part_copy(host_layout: str, layers: range | None) -> None:
    got, want, before = _run_both("store", host_layout, [1, 4, 4], [6, 2, 0], layers)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not torch.equal(got[1], before[1])
