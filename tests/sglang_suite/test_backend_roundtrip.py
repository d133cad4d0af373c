"""Pages written through SGLang's storage interface come back bit-exact, in every pool layout."""

from __future__ import annotations

import pytest
import torch
from sglang_helpers import fill_random, make_pool, names, page_bytes, page_slots

MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
CASES = [("mha", lay) for lay in MHA_LAYOUTS] + [("mla", lay) for lay in MLA_LAYOUTS]


@pytest.mark.parametrize(("kind", "layout"), CASES)
def test_v1_round_trip_is_bit_exact_in_every_layout(backends, disk_url, kind, layout):
    pool = make_pool(kind, layout)
    backend = backends(pool, disk_url, mla=kind == "mla")
    fill_random(pool, seed=1)
    written = list(range(1, 9))
    expected = [page_bytes(pool, p) for p in written]
    keys = names(len(written))
    assert backend.batch_set_v1(keys, page_slots(pool, written)) == [True] * len(keys)
    pool.kv_buffer.zero_()
    landing = list(range(20, 28))  # load into other slots than the ones written from
    assert backend.batch_get_v1(keys, page_slots(pool, landing)) == [True] * len(keys)
    assert [page_bytes(pool, p) for p in landing] == expected


def test_mla_page_first_direct_moves_pages_without_staging(backends, disk_url):
    backend = backends(make_pool("mla", "page_first_direct"), disk_url, mla=True)
    assert backend.describe()["direct"] is True
    other = backends(make_pool("mha", "page_first"), f"{disk_url}-2")
    assert other.describe()["direct"] is False


def test_page_written_from_one_layout_reads_identically_into_another(backends, disk_url):
    writer_pool = make_pool("mha", "page_first")
    reader_pool = make_pool("mha", "layer_first")
    writer = backends(writer_pool, disk_url)
    reader = backends(reader_pool, disk_url)
    fill_random(writer_pool, seed=2)
    keys = names(4)
    assert all(writer.batch_set_v1(keys, page_slots(writer_pool, [0, 1, 2, 3])))
    assert reader.batch_exists(keys) == 4
    assert all(reader.batch_get_v1(keys, page_slots(reader_pool, [4, 5, 6, 7])))
    for src, dst in zip([0, 1, 2, 3], [4, 5, 6, 7], strict=True):
        ps = writer_pool.page_size
        # page_first holds [2, tokens, layers, heads, dim]; layer_first [2, layers, tokens, ...]
        want = writer_pool.kv_buffer[:, src * ps:(src + 1) * ps].transpose(1, 2)
        got = reader_pool.kv_buffer[:, :, dst * ps:(dst + 1) * ps]
        assert torch.equal(want.view(torch.int16), got.view(torch.int16))


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_head"])
def test_generic_api_and_v1_share_pages(backends, disk_url, layout):
    pool = make_pool("mha", layout)
    generic = backends(pool, disk_url, interface_v1=0)
    fill_random(pool, seed=3)
    keys = names(3, tag="g")
    flats = [pool.get_data_page(p * pool.page_size, flat=True) for p in (0, 1, 2)]
    expected = [page_bytes(pool, p) for p in (0, 1, 2)]
    assert generic.batch_set(keys, flats) is True
    pool.kv_buffer.zero_()
    assert generic.batch_get_v1(keys, page_slots(pool, [5, 6, 7])) == [True] * 3
    assert [page_bytes(pool, p) for p in (5, 6, 7)] == expected
    targets = [pool.get_dummy_flat_data_page() for _ in keys]
    got = generic.batch_get(keys, targets)
    for tensor, want in zip(got, expected, strict=True):
        pool.set_from_flat_data_page(9 * pool.page_size, tensor)
        assert page_bytes(pool, 9) == want


def test_single_page_get_and_set(backends, disk_url):
    pool = make_pool("mla", "page_first")
    backend = backends(pool, disk_url, mla=True)
    fill_random(pool, seed=4)
    assert backend.set("k0", pool.get_data_page(0, flat=True)) is True
    assert backend.exists("k0") and not backend.exists("k1")
    page = backend.get("k0", pool.get_dummy_flat_data_page())
    assert page is not None and torch.equal(page.view(torch.int16),
                                            pool.get_data_page(0, flat=True).view(torch.int16))
    assert backend.get("k1", pool.get_dummy_flat_data_page()) is None


@pytest.mark.parametrize("interface_v1", [1, 0])
def test_pool_of_unknown_format_round_trips_as_opaque_pages(backends, disk_url, interface_v1):
    pool = make_pool("mha", "page_first", dtype=torch.int16)  # a dtype kvtier has no layout for
    backend = backends(pool, disk_url, interface_v1=interface_v1)
    assert backend.describe()["kind"] == "opaque"
    fill_random(pool, seed=5)
    keys = names(3, tag="o")
    expected = [page_bytes(pool, p) for p in (0, 1, 2)]
    if interface_v1:
        assert backend.batch_set_v1(keys, page_slots(pool, [0, 1, 2])) == [True] * 3
    else:
        flats = [pool.get_data_page(p * pool.page_size, flat=True) for p in (0, 1, 2)]
        assert backend.batch_set(keys, flats) is True
    pool.kv_buffer.zero_()
    assert backend.batch_get_v1(keys, page_slots(pool, [6, 7, 8])) == [True] * 3
    assert [page_bytes(pool, p) for p in (6, 7, 8)] == expected
