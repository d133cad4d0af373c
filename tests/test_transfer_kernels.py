"""The Triton gather/scatter kernels (interpreted on the CPU) against the torch reference.

Every byte of both pools is compared, so a stray write anywhere fails the test.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.layout import KVLayout
from kvtier.transfer.kernels import KernelConfig, choose_access, launch_copy
from kvtier.transfer.plan import device_geometry, host_geometry, make_plan
from kvtier.transfer.reference import reference_copy
from transfer_support import make_pools, snapshot

# (dtype, page_size, heads, head_dim, mla) chosen so parts are 256, 24, 12, 6 and 9 bytes:
# every access width (16, 8, 4, 2, 1 bytes) is exercised.
SHAPES = [
    ("float32", 4, 2, 8, False),
    ("bfloat16", 3, 1, 4, False),
    ("float16", 1, 1, 6, False),
    ("float8_e4m3fn", 3, 1, 2, False),
    ("uint8", 3, 1, 3, True),
]


def _compare(layout: KVLayout, host_layout: str, direction: str, src: list[int], dst: list[int],
             layers: range | None = None, config: KernelConfig | None = None,
             device_pages: int = 5, host_pages: int = 6) -> None:
    pools = make_pools(layout, device_pages, host_pages, host_layout, seed=11)
    oracle = make_pools(layout, device_pages, host_pages, host_layout, seed=11)
    before = snapshot(*pools)
    dg = device_geometry(layout, device_pages)
    hg = host_geometry(layout, host_pages, host_layout)
    geos = (hg, dg) if direction == "load" else (dg, hg)
    plan = make_plan(direction, *geos, src, dst, layers)
    launch_copy(plan, pools[0].kv, pools[1].buffer, config)
    reference_copy(plan, oracle[0].kv, oracle[1].buffer, host_layout)
    got, want = snapshot(*pools), snapshot(*oracle)
    assert torch.equal(got[0], want[0]), "device pool differs from the reference"
    assert torch.equal(got[1], want[1]), "host pool differs from the reference"
    changed = 0 if direction == "load" else 1
    assert not torch.equal(got[changed], before[changed]), "nothing moved"


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_kernel_load_matches_reference_for_every_dtype_and_width(shape, host_layout) -> None:
    dtype, page_size, heads, head_dim, mla = shape
    layout = KVLayout(2, heads, head_dim, dtype, page_size, mla=mla)
    _compare(layout, host_layout, "load", [5, 0, 2], [1, 4, 0])


@pytest.mark.parametrize("shape", SHAPES[:2] + SHAPES[4:], ids=["float32", "bfloat16", "uint8"])
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_kernel_store_matches_reference(shape, host_layout) -> None:
    dtype, page_size, heads, head_dim, mla = shape
    layout = KVLayout(2, heads, head_dim, dtype, page_size, mla=mla)
    _compare(layout, host_layout, "store", [4, 1, 3], [0, 5, 2])


def test_kernel_moves_only_the_selected_layers() -> None:
    layout = KVLayout(3, 1, 8, "float16", 2)
    _compare(layout, "layer_first", "load", [1, 2], [3, 0], layers=range(1, 2))
    _compare(layout, "page_first", "store", [1, 2], [3, 0], layers=range(1, 3))


def test_kernel_splits_parts_larger_than_a_block_with_a_ragged_tail() -> None:
    # 48-byte parts in 32-byte blocks: two chunks per part, the second half masked.
    layout = KVLayout(2, 1, 8, "float16", 3)
    _compare(layout, "page_first", "load", [0, 3, 5], [4, 2, 1], config=KernelConfig(block_bytes=32))


@pytest.mark.parametrize("programs", [1, 3, 1000])
def test_kernel_persistent_grid_covers_every_item(programs: int) -> None:
    layout = KVLayout(2, 1, 4, "float32", 2)
    _compare(layout, "page_first", "store", [0, 1, 2, 3], [5, 4, 3, 2],
             config=KernelConfig(block_bytes=16, max_programs=programs))


def test_kernel_handles_a_host_buffer_at_an_odd_address() -> None:
    layout = KVLayout(2, 1, 8, "float32", 2)
    dev, host = make_pools(layout, 4, 4, "page_first", seed=5)
    odd = torch.zeros(host.buffer.numel() + 1, dtype=torch.uint8)[1:]
    odd.copy_(host.buffer)
    want = dev.kv.clone()
    plan = make_plan("load", host_geometry(layout, 4, "page_first"), device_geometry(layout, 4),
                     [3, 1], [0, 2])
    reference_copy(plan, want, odd, "page_first")
    launch_copy(plan, dev.kv, odd)
    assert torch.equal(dev.kv.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize(("part_bytes", "pointers", "width"), [
    (65536, (4096, 256), 16), (24, (4096, 256), 8), (12, (0, 64), 4), (6, (64, 64), 2),
    (9, (64, 64), 1), (65536, (4097, 256), 1), (65536, (4100, 256), 4),
])
def test_access_width_is_the_widest_every_address_allows(part_bytes, pointers, width) -> None:
    access = choose_access(part_bytes, pointers, 16384)
    assert access.vector_bytes == width
    assert access.part_vecs * access.vector_bytes == part_bytes


def test_access_block_covers_a_part_in_whole_chunks() -> None:
    access = choose_access(3 * 65536, (0, 0), 16384)
    assert access.block * 4 == 16384 and access.chunks_per_part == 12


@st.composite
def _cases(draw):
    layout = KVLayout(draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 6)),
                      draw(st.sampled_from(["float32", "bfloat16", "float8_e5m2"])),
                      draw(st.integers(1, 4)))
    device_pages, host_pages = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    n = draw(st.integers(0, min(device_pages, host_pages)))
    direction = draw(st.sampled_from(["load", "store"]))
    src_pages, dst_pages = ((host_pages, device_pages) if direction == "load"
                            else (device_pages, host_pages))
    src = draw(st.lists(st.integers(0, src_pages - 1), min_size=n, max_size=n))
    dst = draw(st.permutations(range(dst_pages)))[:n]
    first = draw(st.integers(0, layout.num_layers - 1))
    last = draw(st.integers(first, layout.num_layers - 1))
    host_layout = draw(st.sampled_from(["page_first", "layer_first"]))
    block = draw(st.sampled_from([16, 64, 16384]))
    return layout, host_layout, direction, src, dst, range(first, last + 1), block, (
        device_pages, host_pages)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_kernel_matches_reference_on_random_batches(case) -> None:
    layout, host_layout, direction, src, dst, layers, block, (dp, hp) = case
    pools = make_pools(layout, dp, hp, host_layout, seed=1)
    oracle = make_pools(layout, dp, hp, host_layout, seed=1)
    dg, hg = device_geometry(layout, dp), host_geometry(layout, hp, host_layout)
    geos = (hg, dg) if direction == "load" else (dg, hg)
    plan = make_plan(direction, *geos, src, dst, layers)
    launch_copy(plan, pools[0].kv, pools[1].buffer, KernelConfig(block_bytes=block))
    reference_copy(plan, oracle[0].kv, oracle[1].buffer, host_layout)
    got, want = snapshot(*pools), snapshot(*oracle)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
