"""The model's cache grows in place: hits gathered with room, decode steps written into it."""

from __future__ import annotations

import torch
from tests.test_engine_support import tiny_lm

from kvtier.engine import kv_pages


def _plain_cache(lm):
    from transformers import DynamicCache

    return DynamicCache(config=lm.config)


def test_decode_writes_into_room_without_moving_the_past():
    lm = tiny_lm()
    tokens = torch.arange(20, 60)
    cache = lm.new_cache()
    lm.forward(tokens[:30], cache)
    before = cache.layers[0].keys.data_ptr()
    for step in range(30, 40):
        lm.forward(tokens[step:step + 1], cache)
    assert cache.layers[0].keys.data_ptr() == before  # no concatenation of the past
    assert cache.get_seq_length() == 40
    plain = _plain_cache(lm)
    want = lm.forward(tokens, plain, all_logits=True)[-1]
    got = lm.forward(tokens[39:40], _crop_last(cache))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def _crop_last(cache):
    cache.crop(-1)
    return cache


def test_pages_gathered_with_room_give_the_logits_of_a_cold_run():
    lm = tiny_lm()
    layout = lm.kv_layout(8)
    pool = torch.zeros(layout.num_layers, 2, 12, 8, layout.num_kv_heads, layout.head_dim)
    tokens = torch.arange(100, 140)
    source = lm.new_cache()
    lm.forward(tokens[:32], source)
    kv_pages.write_pages(source, pool, 0, [7, 2, 9, 4])
    reused = lm.new_cache()
    assert kv_pages.append_pages(reused, pool, [7, 2, 9, 4], reserve_tokens=8) == 32
    room = reused.layers[0]._key_buffer.shape[-2]
    assert room >= 40 and reused.get_seq_length() == 32
    got = lm.forward(tokens[32:], reused)
    assert reused.layers[0]._key_buffer.shape[-2] == room  # the suffix fit in the room
    want = lm.forward(tokens, _plain_cache(lm))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_room_grows_by_a_share_of_the_length():
    assert kv_pages.room_for(10) == 320
    assert kv_pages.room_for(32768) == 32768 + 4096
