"""Planner: sizing invariants, sustainability refusals, the load-vs-recompute split, `kvtier plan`."""

from __future__ import annotations

import argparse
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.cli import main
from kvtier.commands import plan as plan_command
from kvtier.layout import KVLayout
from kvtier.planner import (
    PlanInputs,
    StoreRates,
    inputs_from_config,
    load_tokens_per_s,
    plan,
    read_ring_slots_for,
    split_hit,
    staging_slots_for,
    sustainable,
)

LLAMA8B = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=64)
PAGE = LLAMA8B.page_bytes  # 8 MiB


def inputs(**kw) -> PlanInputs:
    base = {"layout": LLAMA8B, "host_pool_bytes": 64 * PAGE, "pinned_budget_bytes": 1 << 34}
    return PlanInputs(**{**base, **kw})


# ---- sizing ----------------------------------------------------------------------------------


def test_staging_slots_round_up():
    assert staging_slots_for(10.0, 0.1, 1.0) == 1
    assert staging_slots_for(10.0, 0.11, 1.0) == 2
    assert staging_slots_for(10.0, 0.3, 2.0) == 6  # exact products do not round up to 7


def test_staging_takes_the_larger_consumer():
    disk = StoreRates("disk", write_bytes_per_s=100 * PAGE, write_residency_s=0.05)
    remote = StoreRates("remote", write_bytes_per_s=40 * PAGE, write_residency_s=0.5)
    p = plan(inputs(stores=(disk, remote), produce_tokens_per_s=100.0, burst_margin=1.5))
    assert [c["staging_slots"] for c in p.consumers] == [8, 30]
    assert p.staging_write_slots == 30 and p.staging_fits


def test_only_write_through_stores_size_staging():
    disk = StoreRates("disk", write_bytes_per_s=100 * PAGE, write_residency_s=0.05)
    cold = StoreRates("remote", write_bytes_per_s=40 * PAGE, write_residency_s=9.0,
                      write_through=False)
    assert plan(inputs(stores=(disk, cold))).staging_write_slots == 10


def test_derived_residency_covers_every_io_worker_in_flight():
    disk = StoreRates("disk", write_bytes_per_s=10 * PAGE, latency_s=0.01)
    p = plan(inputs(stores=(disk,), io_workers=4, burst_margin=1.0))
    assert p.consumers[0]["write_residency_s"] == pytest.approx(0.01 + 4 / 10)
    assert p.staging_write_slots == math.ceil(10 * 0.41)


def test_unsustainable_write_through_refuses_to_size_staging():
    disk = StoreRates("disk", write_bytes_per_s=1e9, write_residency_s=0.01)
    produce = 2e9 / LLAMA8B.bytes_per_token
    p = plan(inputs(stores=(disk,), produce_tokens_per_s=produce))
    assert p.sustainable is False and p.staging_write_slots is None
    assert any("backpressure" in text for text in p.problems)


def test_one_slow_store_makes_the_plan_unsustainable():
    fast = StoreRates("disk", write_bytes_per_s=4e9, write_residency_s=0.01)
    slow = StoreRates("remote", write_bytes_per_s=1e8, write_residency_s=0.01)
    p = plan(inputs(stores=(fast, slow), produce_tokens_per_s=1e9 / LLAMA8B.bytes_per_token))
    assert [c["sustainable"] for c in p.consumers] == [True, False]
    assert p.sustainable is False


def test_sustainable_compares_production_with_drain():
    assert sustainable(1.0, 1.0) and sustainable(0.0, 0.0)
    assert not sustainable(1.0001, 1.0)
    with pytest.raises(ValueError):
        sustainable(-1.0, 1.0)


def test_read_ring_is_sized_by_prefetch_concurrency():
    assert read_ring_slots_for(4, 8) == 32
    p = plan(inputs(io_workers=6, pages_per_read=2))
    assert p.read_ring_slots == 12 and p.read_ring_bytes == 12 * PAGE
    assert plan(inputs(read_ring_slots=5)).read_ring_slots == 5


def test_fits_and_does_not_fit_the_pinned_budget():
    ring = 4 * PAGE
    assert plan(inputs(pinned_budget_bytes=64 * PAGE + ring)).fits_budget
    tight = plan(inputs(pinned_budget_bytes=64 * PAGE + ring - 1))
    assert not tight.fits_budget
    assert "at most 63 host pages" in tight.problems[0]


def test_pool_split_between_prefetch_landing_and_staging():
    p = plan(inputs(host_pool_bytes=65 * PAGE + 100, prefetch_share=0.5))
    assert p.host_pages == 65 and p.host_pool_bytes == 65 * PAGE
    assert p.staging_capacity_pages == 32 and p.prefetch_landing_pages == 33
    assert p.pinned_bytes == 65 * PAGE + p.read_ring_bytes


def test_staging_larger_than_its_share_is_reported():
    disk = StoreRates("disk", write_bytes_per_s=1000 * PAGE, write_residency_s=1.0)
    p = plan(inputs(stores=(disk,)))
    assert p.staging_write_slots == 2000 and p.staging_fits is False
    assert any("staging needs 2000" in text for text in p.problems)


# ---- cost model ------------------------------------------------------------------------------


def test_load_rate_is_bandwidth_over_kv_bytes_per_token():
    assert load_tokens_per_s(131072 * 1000, LLAMA8B.bytes_per_token) == 1000


def test_split_matches_the_measured_cold_disk_case():
    # 2 GB/s cold disk vs 28k tokens/s prefill for an 8B model: about 0.65x recompute time.
    rate = load_tokens_per_s(2e9, LLAMA8B.bytes_per_token)
    split = split_hit(16384, rate, 28000, page_size=64)
    assert split.time_s / split.recompute_all_s == pytest.approx(0.65, abs=0.01)
    assert split.loading_pays and split.recompute_tokens % 64 == 0


def test_fast_tier_loads_almost_everything_and_dead_tier_recomputes_all():
    fast = split_hit(4096, 400_000, 28000, page_size=64)
    assert fast.recompute_tokens <= 4096 * 0.07 and fast.speedup > 10
    dead = split_hit(4096, 0.0, 28000, page_size=64)
    assert dead.recompute_tokens == 4096 and not dead.loading_pays and dead.speedup == 1.0


def test_latency_shifts_work_to_recompute():
    base = split_hit(8192, 20000, 28000, page_size=64)
    slow = split_hit(8192, 20000, 28000, page_size=64, latency_s=0.05)
    assert slow.recompute_tokens > base.recompute_tokens


@settings(max_examples=200, deadline=None)
@given(pages=st.integers(0, 512), page_size=st.sampled_from([1, 16, 64]),
       load=st.floats(0, 1e6), prefill=st.floats(1, 1e6), latency=st.floats(0, 0.5))
def test_split_is_page_aligned_and_never_slower_than_either_extreme(pages, page_size, load,
                                                                     prefill, latency):
    hit = pages * page_size
    split = split_hit(hit, load, prefill, page_size, latency)
    assert split.recompute_tokens + split.load_tokens == hit
    assert split.recompute_tokens % page_size == 0
    assert split.time_s <= split.recompute_all_s * (1 + 1e-12)
    assert split.time_s <= split.load_all_s * (1 + 1e-12)
    for other in range(0, hit + 1, page_size):  # no page boundary does better
        loaded = hit - other
        t_load = 0.0 if loaded == 0 else (math.inf if load <= 0 else latency + loaded / load)
        assert split.time_s <= max(other / prefill, t_load) * (1 + 1e-9)


# ---- kvtier plan -----------------------------------------------------------------------------


def run_plan(argv: list[str]) -> int:
    """``kvtier plan ARGV`` through the command's own parser (other commands not imported)."""
    parser = argparse.ArgumentParser(prog="kvtier")
    plan_command.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv])
    return args.handler(args)


def test_plan_is_a_kvtier_subcommand(capsys):
    assert main(["plan", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits_budget"] is True


def test_plan_command_prints_json_with_the_sizing_keys(capsys):
    rc = run_plan(["--json", "--host.pool_bytes", "1GiB", "--disk-write-bw", "2GB/s",
               "--disk-read-bw", "1.5GB/s", "--prefill-tokens-per-s", "1000"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0
    for name in ("host_pages", "read_ring_slots", "staging_write_slots", "pinned_bytes",
                 "fits_budget", "sustainable"):
        assert name in data
    assert data["host_pages"] == 128 and data["sustainable"] is True


def test_plan_command_refuses_unsustainable_write_through(capsys):
    rc = run_plan(["--disk-write-bw", "100MB/s", "--prefill-tokens-per-s", "28000"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "backpressure is needed" in out and "none is correct" in out


def test_plan_command_fails_when_pool_exceeds_pinned_budget(capsys):
    rc = run_plan(["--host.pool_bytes", "16GiB", "--host.pinned_budget_bytes", "8GiB"])
    assert rc == 1 and "DOES NOT FIT" in capsys.readouterr().out


def test_plan_probe_measures_host_and_disk(capsys, tmp_path):
    rc = run_plan(["--json", "--probe", "--probe-bytes", "8MiB", "--probe-dir",
               str(tmp_path), "--prefill-tokens-per-s", "1"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert data["probed"]["host-bw"] > 0 and data["probed"]["disk-read-bw"] > 0
    assert data["consumers"][0]["write_bytes_per_s"] == data["probed"]["disk-write-bw"]
    assert list(tmp_path.iterdir()) == []


def test_inputs_from_config_take_host_and_controller_sections():
    from kvtier.config import build_config

    config = build_config(env={}, flags={"host.pool_bytes": "1GiB", "host.prefetch_share": "0.25",
                                         "controller.io_workers": "3"})
    got = plan(inputs_from_config(config, LLAMA8B))
    assert got.host_pages == 128 and got.staging_capacity_pages == 96
    assert got.read_ring_slots == 3
