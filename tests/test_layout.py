"""KV layout: sizes, and byte ranges of head and layer slices that reassemble whole pages."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.layout import KVLayout

LAYOUT = KVLayout(num_layers=4, num_kv_heads=8, head_dim=16, dtype="bfloat16", page_size=4)


def _page(layout: KVLayout) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, layout.page_bytes, dtype=np.uint8)


def _gather(page: np.ndarray, ranges) -> np.ndarray:
    return np.concatenate([page[r.offset:r.end] for r in ranges])


def test_page_bytes_matches_shape():
    assert LAYOUT.page_bytes == 4 * 2 * 4 * 8 * 16 * 2
    assert LAYOUT.bytes_per_token * LAYOUT.page_size == LAYOUT.page_bytes
    assert int(np.prod(LAYOUT.page_shape())) * LAYOUT.itemsize == LAYOUT.page_bytes


def test_full_page_is_one_range():
    (only,) = LAYOUT.byte_ranges()
    assert (only.offset, only.length) == (0, LAYOUT.page_bytes)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tp_head_slices_reassemble_page(tp):
    page = _page(LAYOUT)
    view = page.view(np.uint16).reshape(LAYOUT.page_shape())
    shares = []
    for rank in range(tp):
        heads = LAYOUT.head_range_for_rank(rank, tp)
        got = _gather(page, LAYOUT.byte_ranges(heads=heads)).view(np.uint16)
        expected = view[:, :, :, heads[0]:heads[1], :]
        assert np.array_equal(got, expected.reshape(-1))
        shares.append(expected)
    assert np.array_equal(np.concatenate(shares, axis=3), view)


@pytest.mark.parametrize("splits", [[4], [2, 2], [1, 3], [1, 1, 1, 1]])
def test_pp_layer_slices_reassemble_page(splits):
    page = _page(LAYOUT)
    parts, start = [], 0
    for n in splits:
        ranges = LAYOUT.byte_ranges(layers=(start, start + n))
        assert len(ranges) == 1  # whole layers are contiguous
        parts.append(_gather(page, ranges))
        start += n
    assert np.array_equal(np.concatenate(parts), page)


def test_tp_and_pp_slice_together():
    page = _page(LAYOUT)
    view = page.view(np.uint16).reshape(LAYOUT.page_shape())
    got = _gather(page, LAYOUT.byte_ranges(heads=(2, 4), layers=(1, 3))).view(np.uint16)
    assert np.array_equal(got, view[1:3, :, :, 2:4, :].reshape(-1))
    assert LAYOUT.slice_bytes(heads=(2, 4), layers=(1, 3)) == got.nbytes * 1


def test_mla_layout_has_one_latent_part():
    mla = KVLayout(num_layers=3, num_kv_heads=1, head_dim=576, dtype="bfloat16", page_size=8, mla=True)
    assert mla.parts == 1
    assert mla.page_bytes == 3 * 8 * 576 * 2
    assert mla.head_range_for_rank(3, 8) == (0, 1)  # every rank holds the latent
    page = _page(mla)
    parts = [_gather(page, mla.byte_ranges(layers=(i, i + 1))) for i in range(3)]
    assert np.array_equal(np.concatenate(parts), page)


def test_fingerprint_changes_with_each_field():
    variants = [
        KVLayout(5, 8, 16, "bfloat16", 4), KVLayout(4, 4, 16, "bfloat16", 4),
        KVLayout(4, 8, 32, "bfloat16", 4), KVLayout(4, 8, 16, "float16", 4),
        KVLayout(4, 8, 16, "bfloat16", 8),
    ]
    prints = {v.fingerprint() for v in variants} | {LAYOUT.fingerprint()}
    assert len(prints) == len(variants) + 1


@pytest.mark.parametrize("kwargs", [
    {"num_layers": 0}, {"num_kv_heads": -1}, {"head_dim": 1.5}, {"dtype": "float64"},
    {"page_size": 0}, {"mla": True},
])
def test_bad_layout_is_a_config_error(kwargs):
    base = {"num_layers": 4, "num_kv_heads": 8, "head_dim": 16, "dtype": "bfloat16", "page_size": 4}
    with pytest.raises(ConfigError):
        KVLayout(**{**base, **kwargs})


def test_bad_ranges_raise():
    with pytest.raises(ValueError):
        LAYOUT.byte_ranges(heads=(4, 9))
    with pytest.raises(ValueError):
        LAYOUT.byte_ranges(layers=(2, 2))
    with pytest.raises(ValueError):
        LAYOUT.head_range_for_rank(0, 3)  # 8 heads do not split over 3


def test_a_head_range_layout_is_the_canonical_page_of_that_slice():
    page = _page(LAYOUT)
    share = LAYOUT.for_heads((2, 6))
    assert (share.num_kv_heads, share.num_layers, share.page_size) == (4, 4, 4)
    assert share.page_bytes == LAYOUT.slice_bytes(heads=(2, 6))
    sliced = _gather(page, LAYOUT.byte_ranges(heads=(2, 6)))
    view = sliced.view(np.uint16).reshape(share.page_shape())
    assert np.array_equal(view, page.view(np.uint16).reshape(LAYOUT.page_shape())[:, :, :, 2:6])
    with pytest.raises(ValueError):
        LAYOUT.for_heads((6, 6))
