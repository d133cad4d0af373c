"""``benchmarks/vllm/vllm_serve.py``'s pure parts (its modules ``vllm_serve_plan.py`` and
``vllm_serve_server.py``): the working set of a workload, the memory plan that keeps it off the
GPU (kvtier's staging pages inside the same GPU budget, the same host GiB for native offloading
and kvtier), the servers' flags, and the counters read from ``/metrics``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "vllm"))

import vllm_serve_plan
import vllm_serve_report
import vllm_serve_server
from kvtier.bench.serve_workloads import shared_prefix


def _args(**over: object) -> argparse.Namespace:
    base = dict(preset="llama3-8b-shape", dtype="bfloat16", block_size=16, concurrency=4, seed=0,
                groups=24, prefix_len=4096, suffix_len=256, rounds=3, conversations=32, turns=5,
                system_len=1024, user_len=384, output_len=64, gpu_kv_fraction=0.25,
                inflight_headroom=1.25, gpu_kv_bytes=0, host_gib=0.0, staging_pages=0,
                kvtier_extra_gpu=False, workloads=list(vllm_serve_plan.WORKLOADS), eager=False,
                model_dir="/m", vllm_args="")
    base.update(over)
    return argparse.Namespace(**base)


def test_working_set_counts_each_distinct_block_once_plus_outputs():
    requests = shared_prefix(8, 2, 64, 16, 4, vocab=500)     # 2 prefixes of 4 blocks
    assert vllm_serve_plan.working_set_tokens(requests, 16) == (2 * 4 + 8) * 16 + 8 * 4
    assert vllm_serve_plan.working_set_tokens(requests, 32) == (2 * 2) * 32 + 8 * 4  # 80: 2 blocks


def test_plan_keeps_the_working_set_off_the_gpu_and_gives_every_server_the_same_kv_bytes():
    args = _args()
    plan = vllm_serve_plan.plan_memory(args, vllm_serve_plan.build_workloads(args))
    assert plan["kv_bytes_per_token"] == 32 * 8 * 128 * 2 * 2
    assert all(share < 1 for share in plan["gpu_share_of_working_set"].values())
    assert plan["kvtier_staging_pages"] == 4 * (4096 + 256) // 16      # a prompt per request
    assert plan["kvtier_vllm_kv_bytes"] + plan["kvtier_staging_bytes"] == plan["gpu_kv_bytes"]
    inflight = 4 * plan["longest_request_tokens"] * plan["kv_bytes_per_token"]
    assert plan["kvtier_vllm_kv_bytes"] >= inflight                       # no preemption
    extra = vllm_serve_plan.plan_memory(_args(kvtier_extra_gpu=True),
                                        vllm_serve_plan.build_workloads(args))
    assert extra["kvtier_vllm_kv_bytes"] == extra["gpu_kv_bytes"]


def test_native_and_kvtier_get_the_same_host_memory():
    args = _args()
    plan = vllm_serve_plan.plan_memory(args, vllm_serve_plan.build_workloads(args))
    native = vllm_serve_server.server_command(args, "native", 8000, plan)
    kvtier = vllm_serve_server.server_command(args, "kvtier", 8000, plan)
    alone = vllm_serve_server.server_command(args, "alone", 8000, plan)
    gib = native[native.index("--kv-offloading-size") + 1]
    extra = json.loads(kvtier[kvtier.index("--kv-transfer-config") + 1])
    assert extra["kv_connector"] == "KvtierConnector"
    assert extra["kv_connector_extra_config"]["host_pool_bytes"] == f"{gib}GiB"
    assert "--kv-offloading-size" not in alone and "--kv-transfer-config" not in alone
    memory = [c[c.index("--kv-cache-memory-bytes") + 1] for c in (alone, native, kvtier)]
    assert memory[0] == memory[1] == str(plan["gpu_kv_bytes"])
    assert memory[2] == str(plan["kvtier_vllm_kv_bytes"])


def test_counters_are_summed_over_labels_and_only_the_wanted_ones():
    text = "\n".join([
        "# HELP vllm:prefix_cache_hits_total hits",
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 12.0',
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 3.0',
        'vllm:prefix_cache_hits_created{engine="0"} 1.7e9',
        'vllm:kvtier_hit_tokens_host_total{engine="0"} 4096.0',
        'vllm:kv_offload_load_bytes_sum{engine="0"} 1e6',
        'vllm:kv_offload_load_bytes_bucket{le="1"} 5',
        'vllm:kv_offload_cpu_cache_usage_perc{engine="0"} 0.5',
        'vllm:generation_tokens_total{engine="0"} 99',
        'vllm:request_queue_time_seconds_sum{engine="0"} 0.5',
        'vllm:request_queue_time_seconds_count{engine="0"} 10',
        'vllm:request_queue_time_seconds_bucket{engine="0",le="0.1"} 4'])
    counters = vllm_serve_server.parse_counters(text)
    assert counters == {
        "vllm:prefix_cache_hits": 15.0, "vllm:kvtier_hit_tokens_host": 4096.0,
        "vllm:kv_offload_load_bytes_sum": 1e6, "vllm:request_queue_time_seconds_sum": 0.5,
        "vllm:request_queue_time_seconds_count": 10.0}
    assert vllm_serve_report.phases({"native": {"w": {"vllm_counters": counters}}}, ["w"]) == [
        "vLLM's phases, w, native, mean ms per request: queued 50.0, scheduled to first token "
        "-, TTFT -"]


def test_the_connectors_cpu_is_reported_per_request():
    counters = {"vllm:kvtier_worker_hooks_us": 50_000.0, "vllm:kvtier_save_plan_cpu_us": 10_000.0,
                "vllm:kvtier_lookup_us": 20_000.0, "vllm:kvtier_saves_to_host_only": 3.0}
    lines = vllm_serve_report.connector_cpu(
        "kvtier", {"shared-prefix": {"requests": 10, "vllm_counters": counters},
         "multi-turn": {"requests": 5, "vllm_counters": {}}}, ["shared-prefix", "multi-turn"])
    assert lines == ["kvtier's connector CPU in vLLM's loop (kvtier), shared-prefix, ms per "
                     "request: step "
                     "hooks 5.00 (saves: plan 1.00, copy 0.00, commit 0.00), lookups 2.00, step "
                     "metadata 0.00; saves to host only 3"]
