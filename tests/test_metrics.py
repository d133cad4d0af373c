"""Prometheus output: well-formed (prometheus_client's parser, promtool where installed), complete,
and equal to what the requests and the cache report."""

from __future__ import annotations

import shutil
import subprocess
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cache_support import LAYOUT, make_cache, prompt, serve
from kvtier.engine.request import PrefillReport
from kvtier.engine.request_stats import LatencyHistogram, RequestStats
from kvtier.metrics import render_metrics
from kvtier.store.memory import MemoryStore
from test_engine_support import make_config, running_server

REQUIRED = {
    "kvtier_prompt_tokens": "counter", "kvtier_cached_tokens": "counter",
    "kvtier_store_bytes": "counter", "kvtier_store_errors": "counter",
    "kvtier_page_corrupt": "counter", "kvtier_prefetch": "counter",
    "kvtier_read_ring_overflow": "counter", "kvtier_write_refused": "counter",
    "kvtier_pinned_bytes": "gauge", "kvtier_pages": "gauge",
    "kvtier_time_to_first_token_seconds": "histogram", "kvtier_requests": "counter",
    "kvtier_requests_rejected": "counter", "kvtier_binding_generation": "gauge",
    "kvtier_store_dropped_pages": "counter", "kvtier_store_recovered_records": "counter",
}


def families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def cache_snapshot() -> dict:
    stats = RequestStats()
    report = PrefillReport(prompt_tokens=100, cached_tokens=64, computed_tokens=36,
                           queue_s=0.002, prefill_s=0.04)
    report.cached_by_tier.update(device=48, disk=16)
    stats.observe("stop", report, completion_tokens=5, ttft_s=0.05)
    stats.observe("cancelled")
    disk = MemoryStore(LAYOUT.page_bytes, max_bytes=LAYOUT.page_bytes * 64)
    with make_cache(stores={"disk": disk}) as cache:
        serve(cache, prompt(6, seed=1))
        assert cache.drain()
        return {"info": {"version": "t", "model": "m"}, "requests": stats.snapshot(),
                "scheduler": {"queued": 1, "running": 2, "rejected": 3, "steps": 7,
                              "batched_tokens": 90, "preempted": 1, "ahead_steps": 5,
                              "ahead_rows_taken": 9, "ahead_rows_dropped": 2},
                "http": {"in_flight": 2, "rejected_total": {"body_too_large": 4}},
                "cache": cache.stats(),
                "bindings": {"slots": {"store.disk": {"generation": 2, "swaps": 1}}}}


def test_every_required_family_is_present_with_its_type() -> None:
    found = families(render_metrics(cache_snapshot()).decode())
    for name, kind in REQUIRED.items():
        assert name in found, name
        assert found[name].type == kind, name
    assert all(name.startswith("kvtier_") for name in found
               if name != "prompt_tokens_cached_by_source")  # the router-read name of one count


def test_series_carry_the_numbers_of_the_snapshot() -> None:
    text = render_metrics(cache_snapshot()).decode()
    cached = samples(text, "kvtier_cached_tokens_total")
    assert cached[(("tier", "device"),)] == 48 and cached[(("tier", "disk"),)] == 16
    by_source = samples(text, "prompt_tokens_cached_by_source_total")
    assert by_source == {(("source", t),): cached[(("tier", t),)] for t in
                         ("device", "host", "disk", "remote")}
    assert samples(text, "kvtier_prompt_tokens_total") == {(): 100.0}
    written = samples(text, "kvtier_store_bytes_total")
    assert written[(("backend", "memory"), ("direction", "write"), ("tier", "disk"))] == \
        6 * LAYOUT.page_bytes
    assert samples(text, "kvtier_pages")[(("tier", "disk"),)] == 6
    assert samples(text, "kvtier_requests_total") == {(("outcome", "cancelled"),): 1.0,
                                                      (("outcome", "stop"),): 1.0}
    rejected = samples(text, "kvtier_requests_rejected_total")
    assert rejected == {(("reason", "body_too_large"),): 4.0, (("reason", "queue_full"),): 3.0}
    assert samples(text, "kvtier_engine_steps_total") == {(): 7.0}
    assert samples(text, "kvtier_engine_batched_tokens_total") == {(): 90.0}
    assert samples(text, "kvtier_engine_preempted_total") == {(): 1.0}
    assert samples(text, "kvtier_engine_ahead_steps_total") == {(): 5.0}
    assert samples(text, "kvtier_engine_ahead_rows_taken_total") == {(): 9.0}
    assert samples(text, "kvtier_engine_ahead_rows_dropped_total") == {(): 2.0}


def test_a_rebuilt_store_index_is_counted_by_outcome() -> None:
    snapshot = cache_snapshot()
    stores = snapshot["cache"]["stores"]
    stores["disk"] = {**stores["disk"], "recovered": 22, "recovery_skipped": 2}
    got = samples(render_metrics(snapshot).decode(), "kvtier_store_recovered_records_total")
    who = (("backend", "memory"), ("tier", "disk"))
    assert got[tuple(sorted((*who, ("outcome", "recovered"))))] == 22
    assert got[tuple(sorted((*who, ("outcome", "skipped"))))] == 2


def test_kv_event_counters_appear_only_when_events_are_on() -> None:
    snap = cache_snapshot()
    assert "kvtier_kv_events" not in families(render_metrics(snap).decode())
    snap["kv_events"] = {"recorder": {"put_total": 9, "dropped_total": 2},
                         "publisher": {"events": 7, "batches": 3, "replay_requests": 1,
                                       "replay_invalid": 0}}
    text = render_metrics(snap).decode()
    assert samples(text, "kvtier_kv_events_total") == {
        (("outcome", "recorded"),): 9, (("outcome", "dropped"),): 2, (("outcome", "published"),): 7}
    assert samples(text, "kvtier_kv_event_batches_total") == {(): 3}


def test_selective_writes_report_their_measured_return_rate() -> None:
    with make_cache(write_policy="write_through_selective") as cache:
        serve(cache, prompt(4, seed=2))
        snap = {"cache": cache.stats()}
    assert snap["cache"]["write_selection"]["probes_total"] == 1
    text = render_metrics(snap).decode()
    assert samples(text, "kvtier_write_selective_fresh_return_rate") == {(): -1.0}  # no evidence
    snap["cache"]["write_selection"].update(fresh_return_rate=0.75, fresh_admitted_pages=12)
    text = render_metrics(snap).decode()
    assert samples(text, "kvtier_write_selective_fresh_return_rate") == {(): 0.75}
    assert samples(text, "kvtier_write_selective_fresh_pages_total") == {(): 12.0}
    assert "kvtier_write_selective_fresh_return_rate" not in families(
        render_metrics(cache_snapshot()).decode())          # write-through: no such series


def test_histogram_buckets_are_cumulative_and_end_at_the_count() -> None:
    text = render_metrics(cache_snapshot()).decode()
    buckets = samples(text, "kvtier_time_to_first_token_seconds_bucket")
    ordered = sorted(buckets.items(), key=lambda kv: float(dict(kv[0])["le"]))
    counts = [value for _, value in ordered]
    assert counts == sorted(counts) and dict(ordered[-1][0])["le"] == "+Inf"
    assert counts[-1] == samples(text, "kvtier_time_to_first_token_seconds_count")[()] == 1
    assert buckets[(("le", "0.05"),)] == 1 and buckets[(("le", "0.025"),)] == 0


def test_a_value_on_a_bound_falls_in_that_bucket() -> None:
    hist = LatencyHistogram((0.1, 1.0))
    for value in (0.1, 0.5, 1.0, 7.0, -3.0):
        hist.observe(value)
    assert hist.snapshot()["counts"] == [2, 2, 1]
    with pytest.raises(ValueError):
        LatencyHistogram((1.0, 0.5))


def test_missing_parts_leave_their_series_out_without_failing() -> None:
    text = render_metrics({}).decode()
    found = families(text)
    assert samples(text, "kvtier_cache_stats_ok") == {(): 0.0}
    assert "kvtier_pages" not in found and "kvtier_requests_rejected" in found


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_output() -> None:
    text = render_metrics(cache_snapshot())
    checked = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                             timeout=60, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_metrics_endpoint_adds_up_to_what_the_requests_reported() -> None:
    config = make_config(store__disk_url=f"memory://metrics-{uuid.uuid4().hex}",
                         controller__min_prefetch_tokens=0)
    body = {"model": "tiny-llama", "max_tokens": 2, "temperature": 0,
            "prompt": "Count every token the cache served. " * 3}
    with running_server(config) as (_, url):
        usages = [httpx.post(url + "/v1/completions", json=body, timeout=60).json()["usage"]
                  for _ in range(3)]
        resp = httpx.get(url + "/metrics")
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = resp.text
    assert samples(text, "kvtier_prompt_tokens_total")[()] == sum(u["prompt_tokens"]
                                                                 for u in usages)
    cached = samples(text, "kvtier_cached_tokens_total")
    for tier in ("device", "host", "disk", "remote"):
        want = sum(u["kvtier"]["cached_tokens_by_tier"][tier] for u in usages)
        assert cached[(("tier", tier),)] == want, tier
    assert sum(cached.values()) > 0
    assert samples(text, "kvtier_time_to_first_token_seconds_count")[()] == 3
    assert samples(text, "kvtier_cache_stats_ok") == {(): 1.0}
