"""The connector's scheduler half under vLLM's real ``Scheduler`` (no model runs).

Pages are put into kvtier directly (``fill_kvtier``); the tests check what vLLM schedules from
the connector's answers: claimed tokens, load and save plans, hit sources, refusals at start, and
what happens when a staged load is lost before the worker copies it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scheduler_harness import (
    BLOCK,
    admit,
    fill_kvtier,
    make_kv_cache_config,
    make_request,
    make_scheduler,
    make_vllm_config,
    ramp,
    runner_output,
)

from kvtier.errors import ConfigError

pytestmark = pytest.mark.timeout(600)


def test_stored_pages_are_claimed_and_planned_as_one_load(scheduler):
    tokens = ramp(100)
    fill_kvtier(scheduler.connector.runtime, tokens)
    request, out = admit(scheduler, tokens)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 96     # three full 32-token pages
    assert out.num_scheduled_tokens[request.request_id] == 4
    (load,) = out.kv_connector_metadata.loads
    assert (load.req_id, load.start, load.end) == (request.request_id, 0, 96)
    assert list(load.block_ids[:3]) == list(out.scheduled_new_reqs[0].block_ids[0][:3])
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    assert scheduler.connector.get_external_cache_hit_sources(request, 96) == {
        CacheHitSource.HOST: 96}


def test_a_fully_stored_prompt_leaves_its_last_token_to_compute(scheduler):
    tokens = ramp(96)
    fill_kvtier(scheduler.connector.runtime, tokens)
    request, out = admit(scheduler, tokens)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 95
    assert out.num_scheduled_tokens[request.request_id] == 1


def test_a_different_cache_salt_is_not_claimed(scheduler):
    tokens = ramp(100)
    fill_kvtier(scheduler.connector.runtime, tokens, salt="tenant-a")
    _, out = admit(scheduler, tokens, salt="tenant-b")
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert out.kv_connector_metadata.loads == []
    _, same_tenant = admit(scheduler, tokens, salt="tenant-a")
    assert same_tenant.scheduled_new_reqs[0].num_computed_tokens == 96


def test_the_prompt_is_saved_once_when_its_chunked_prefill_completes(scheduler):
    tokens = ramp(150, start=300)
    request, out = admit(scheduler, tokens)
    saves = [out.kv_connector_metadata.saves]
    blocks = list(out.scheduled_new_reqs[0].block_ids[0])
    for _ in range(2):                                   # 64 + 64 + 22 prompt tokens
        scheduler.update_from_output(out, runner_output(out))
        out = scheduler.schedule()
        saves.append(out.kv_connector_metadata.saves)
        for new_blocks in out.scheduled_cached_reqs.new_block_ids:
            blocks.extend(new_blocks[0] if new_blocks else [])
    assert out.scheduled_cached_reqs.num_computed_tokens == [128]
    planned = [s for step in saves for s in step]
    assert len(planned) == 1 and saves[0] == [] and saves[1] == []
    (save,) = planned
    assert save.tokens == tuple(tokens[:128]) and save.block_ids == tuple(blocks[:4])


def test_a_prompt_kvtier_already_holds_is_not_saved_again(scheduler):
    tokens = ramp(100, start=500)
    fill_kvtier(scheduler.connector.runtime, tokens)
    _, out = admit(scheduler, tokens)
    assert out.kv_connector_metadata.saves == []


def test_a_request_opted_out_of_kvtier_is_neither_served_nor_stored(scheduler):
    tokens = ramp(100, start=600)
    fill_kvtier(scheduler.connector.runtime, tokens)
    request = make_request(tokens, BLOCK, kv_transfer_params={"kvtier_cache": False})
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    other = make_request(ramp(100, start=650), BLOCK, kv_transfer_params={"kvtier_cache": False})
    scheduler.add_request(other)
    for _ in range(3):
        scheduler.update_from_output(out, runner_output(out))
        out = scheduler.schedule()
        assert out.kv_connector_metadata.saves == []
    counts = scheduler.connector.runtime.counts
    assert counts["requests_opted_out"] == 2 and counts.get("lookups", 0) == 0


def test_a_malformed_kvtier_cache_param_is_counted_and_ignored(scheduler):
    tokens = ramp(100, start=800)
    fill_kvtier(scheduler.connector.runtime, tokens)
    request = make_request(tokens, BLOCK, kv_transfer_params={"kvtier_cache": "no"})
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 96
    assert scheduler.connector.runtime.counts["bad_kvtier_cache_params"] == 1


def test_a_lost_staged_load_is_reported_and_vllm_recomputes_it(tiny_model, tmp_path):
    from kvtier.integrations.vllm.worker import WorkerSide

    config = make_vllm_config(tiny_model, {"disk_url": f"file://{tmp_path / 'disk'}",
                                           "host_pool_bytes": "8MiB"},
                              block_size=BLOCK, policy="recompute")
    sched = make_scheduler(config, make_kv_cache_config(BLOCK))
    runtime = sched.connector.runtime
    try:
        tokens = ramp(100, start=700)
        fill_kvtier(runtime, tokens)
        request, out = admit(sched, tokens)
        runtime.release_staged(request.request_id)           # the staged pages are gone
        worker = WorkerSide(runtime)
        kv = {name: torch.zeros(256, 2, BLOCK, 64) for name in runtime.shape.layer_names}
        worker.register_kv_caches(kv, "CPU_ATTN")
        worker.start_load_kv(out.kv_connector_metadata)
        failed = worker.get_block_ids_with_load_errors()
        assert failed == set(out.scheduled_new_reqs[0].block_ids[0][:3])
        assert runtime.counts["load_errors"] == 1
        sched.update_from_output(out, runner_output(out, invalid_block_ids=failed))
        assert request.num_computed_tokens == 0        # vLLM recomputes from the first block
    finally:
        runtime.close()


def _windowed_scheduler(model: Path, tmp: Path, spec):
    config = make_vllm_config(model, {"host_pool_bytes": "8MiB", "staging_pages": 64,
                                      "disk_url": f"file://{tmp / 'disk'}"}, block_size=BLOCK,
                              max_batched=256)
    return make_scheduler(config, make_kv_cache_config(BLOCK, spec=spec))


def test_a_group_keeping_only_the_windows_blocks_is_neither_served_nor_stored(tiny_model,
                                                                              tmp_path):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    spec = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=32,
                             dtype=torch.float32, sliding_window=64)
    sched = _windowed_scheduler(tiny_model, tmp_path, spec)
    runtime = sched.connector.runtime
    try:
        assert "SlidingWindowSpec(window=64)" in runtime.shape.refused
        tokens = ramp(100)
        fill_kvtier(runtime, tokens)                   # held by kvtier, yet never claimed
        request, out = admit(sched, tokens)
        assert out.scheduled_new_reqs[0].num_computed_tokens == 0
        assert out.kv_connector_metadata.loads == []
        assert out.kv_connector_metadata.saves == []   # the whole prompt ran this step
        assert runtime.counts["requests_refused_model_kv"] == 1
        sched.update_from_output(out, runner_output(out))
        assert sched.connector.request_finished(request, [1, 2, 3, 4]) == (False, None)
        assert runtime.saver.counts["saves_queued"] == 0
    finally:
        runtime.close()


def test_sliding_window_layers_in_full_attention_blocks_are_served(tiny_model, tmp_path):
    """What vLLM gives a connector without ``SupportsHMA`` for a hybrid model: every layer
    keeps every token's KV, so a hit restores it exactly."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32,
                             dtype=torch.float32, sliding_window=64)
    sched = _windowed_scheduler(tiny_model, tmp_path, spec)
    runtime = sched.connector.runtime
    try:
        assert runtime.shape.refused == ""
        tokens = ramp(100)
        fill_kvtier(runtime, tokens)
        _, out = admit(sched, tokens)
        assert out.scheduled_new_reqs[0].num_computed_tokens == 96
        assert runtime.counts["requests_refused_model_kv"] == 0
    finally:
        runtime.close()


def test_an_unknown_connector_setting_is_refused_at_start(tiny_model):
    config = make_vllm_config(tiny_model, {"disk_ur": "file:///tmp/x"}, block_size=BLOCK)
    with pytest.raises(ConfigError, match="disk_ur"):
        make_scheduler(config, make_kv_cache_config(BLOCK))


def test_rows_saved_from_vllm_blocks_load_back_into_other_blocks_exactly(scheduler):
    from kvtier.integrations.vllm.layout import BlockLayout
    from kvtier.integrations.vllm.scheduler import KvtierConnectorMetadata, LoadSpec, SaveSpec
    from kvtier.integrations.vllm.worker import WorkerSide

    runtime = scheduler.connector.runtime
    worker = WorkerSide(runtime)
    source = {n: torch.randn(64, 2, BLOCK, 64) for n in runtime.shape.layer_names}
    worker.register_kv_caches(source, "CPU_ATTN")
    tokens = ramp(96, start=40)
    saving = KvtierConnectorMetadata(saves=[SaveSpec("w", tuple(tokens), None, (5, 9, 2))])
    for name, kv in source.items():
        worker.save_kv_layer(saving, name, kv)
    worker.wait_for_save(saving)
    assert runtime.saver.drain(30.0)
    assert runtime.counts["saved_tokens"] == 96
    # The events say what kvtier serve's stream says: kvtier's pages on its device tier (GPU)
    # and, once copied, its host tier (CPU), named by the last 8 bytes of kvtier's page keys.
    from vllm.distributed.kv_events import BlockStored

    from kvtier.events.blocks import key_hash
    from kvtier.keys import page_keys

    want = [key_hash(bytes(k)) for k in page_keys(tokens, BLOCK, runtime.namespace, None)]
    stored: dict[str, list[int]] = {}
    for event in scheduler.connector.take_events():
        if isinstance(event, BlockStored):
            assert event.block_size == BLOCK
            first = want.index(event.block_hashes[0]) * BLOCK
            assert event.token_ids == tokens[first:first + BLOCK * len(event.block_hashes)]
            stored.setdefault(event.medium, []).extend(event.block_hashes)
    assert stored == {"GPU": want, "CPU": want}
    assert list(scheduler.connector.take_events()) == []
    with runtime.lock:
        runtime.staged["r"] = runtime.cache.load(runtime.cache.match(tokens))
    target = {n: torch.zeros(64, 2, BLOCK, 64) for n in runtime.shape.layer_names}
    worker.kv_caches = target
    worker.start_load_kv(KvtierConnectorMetadata(loads=[LoadSpec("r", 0, 95, (7, 3, 11))]))
    for name in target:
        worker.wait_for_layer_load(name)
    worker.wait_for_save(KvtierConnectorMetadata())
    layout = BlockLayout("cpu", 64, BLOCK, 2, 32)
    old = torch.cat([torch.arange(b * BLOCK, (b + 1) * BLOCK) for b in (5, 9, 2)])[:95]
    new = torch.cat([torch.arange(b * BLOCK, (b + 1) * BLOCK) for b in (7, 3, 11)])[:95]
    for name in target:
        for got, want in zip(layout.read(target[name], new), layout.read(source[name], old),
                             strict=True):
            assert torch.equal(got, want)
        assert int(layout.read(target[name], torch.tensor([11 * BLOCK + 31]))[0].abs().sum()) == 0


def test_counters_reach_vllms_connector_stats_log_and_prometheus(scheduler):
    from prometheus_client import REGISTRY
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorLogging,
        KVConnectorProm,
    )

    connector = scheduler.connector
    connector.get_kv_connector_stats()                  # what start-up counted, if anything
    tokens = ramp(100)
    fill_kvtier(connector.runtime, tokens)
    admit(scheduler, tokens)
    stats = connector.get_kv_connector_stats()
    by_tier = {k: v for k, v in stats.data.items() if k.startswith("hit_tokens_")}
    assert sum(by_tier.values()) == 96 and stats.data["claimed_tokens"] == 96
    assert stats.data["lookups"] == 1
    assert stats.data["lookup_us"] > 0                  # the connector's CPU in the loop, too
    assert connector.get_kv_connector_stats() is None  # nothing moved since the last report
    config = scheduler.vllm_config
    logging = KVConnectorLogging(config.kv_transfer_config)   # vLLM's periodic log line
    logging.observe(stats.data)
    logging.observe({"claimed_tokens": 4})
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert "claimed_tokens=100" in lines[0] and "lookups=1" in lines[0]
    prom = KVConnectorProm(config, ["model_name", "engine"], {0: ["tiny", "0"]})
    prom.observe(stats.data, 0)
    labels = {"model_name": "tiny", "engine": "0"}
    assert REGISTRY.get_sample_value("vllm:kvtier_claimed_tokens_total", labels) == 96
    assert REGISTRY.get_sample_value("vllm:kvtier_hit_tokens_disk_total", labels) == 0


def test_a_damaged_disk_store_and_an_unreachable_redis_do_not_stop_vllm(tiny_model, tmp_path):
    # A cache is an accelerator: the connector starts with those tiers off (the damaged
    # directory moved aside, Redis retried in the background) and vLLM schedules as usual.
    disk = tmp_path / "disk"
    disk.mkdir()
    (disk / "kvtier-store.json").write_text("{ not json")
    config = make_vllm_config(tiny_model, {"disk_url": f"file://{disk}",
                                           "remote_url": "redis://127.0.0.1:1/0",
                                           "remote_timeout_s": 0.2,
                                           "host_pool_bytes": "8MiB", "staging_pages": 64},
                              block_size=BLOCK, max_batched=64)
    sched = make_scheduler(config, make_kv_cache_config(BLOCK))
    try:
        health = sched.connector.runtime.cache.store_health()
        assert health["remote"]["state"] == "off"
        assert any(p.name.startswith("disk.corrupt-") for p in tmp_path.iterdir())
        request, out = admit(sched, ramp(100))
        assert out.scheduled_new_reqs[0].num_computed_tokens == 0
        assert out.num_scheduled_tokens[request.request_id] == 64     # max_batched: computed
    finally:
        sched.connector.runtime.close()
