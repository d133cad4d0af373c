"""Pricing a replay in prefill GPU time with the planner's load-vs-recompute model."""

from __future__ import annotations

import pytest

from kvtier.replay.savings import (
    H200_8B_PREFILL,
    MODEL_SHAPES,
    PrefillModel,
    prefill_model,
    price,
)

EIGHT_B = MODEL_SHAPES["8b"]


def test_prefill_fit_reproduces_the_measured_h200_times():
    model = prefill_model(EIGHT_B)
    for tokens, seconds in H200_8B_PREFILL:
        assert model.time(tokens) == pytest.approx(seconds, rel=0.07)


def test_fit_needs_two_distinct_lengths():
    with pytest.raises(ValueError):
        PrefillModel.fit([(1024, 0.03), (1024, 0.03)])


def test_kv_bytes_per_token_of_the_model_shapes():
    assert EIGHT_B.kv_bytes_per_token == 128 * 1024
    assert MODEL_SHAPES["70b"].kv_bytes_per_token == 320 * 1024


def test_a_device_hit_saves_the_prefill_of_its_prefix():
    model = prefill_model(EIGHT_B)
    saved = price([(8192, 4096, 0, 0)], EIGHT_B)
    assert saved.saved_s == pytest.approx(model.time(4096))
    assert saved.prefill_s == pytest.approx(model.time(8192))


def test_host_hits_save_almost_as_much_as_device_hits_and_disk_hits_less():
    device = price([(8192, 4096, 0, 0)], EIGHT_B).saved_s
    host = price([(8192, 0, 4096, 0)], EIGHT_B).saved_s
    disk = price([(8192, 0, 0, 4096)], EIGHT_B).saved_s
    assert 0.9 * device < host < device
    assert 0 < disk < 0.5 * host


def test_a_bigger_model_saves_more_gpu_time_for_the_same_hits():
    hits = [(8192, 2048, 2048, 2048)]
    assert price(hits, MODEL_SHAPES["70b"]).saved_s > 5 * price(hits, EIGHT_B).saved_s
