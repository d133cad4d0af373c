"""``kvtier serve --kv-events``: the engine service publishes its cache's moves, off by default."""

from __future__ import annotations

import time

import pytest

from events_support import apply_payload, new_view
from kvtier.config import build_config
from kvtier.engine.request import GenerationRequest
from kvtier.engine.service import EngineService
from kvtier.errors import ConfigError
from test_engine_support import make_config, tiny_lm

zmq = pytest.importorskip("zmq")


def test_the_kv_events_flag_sets_the_endpoint():
    import argparse

    from kvtier.config_flags import add_config_flags, config_from_args

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    args = parser.parse_args(["--kv-events", "tcp://127.0.0.1:5557",
                              "--server.kv_events_topic", "kv@pod@m"])
    server = config_from_args(args, env={}).server
    assert (server.kv_events_endpoint, server.kv_events_topic) == ("tcp://127.0.0.1:5557",
                                                                   "kv@pod@m")
    assert build_config(env={}).server.kv_events_endpoint == ""  # off by default


def test_a_served_prompt_reaches_a_subscriber_as_gpu_and_cpu_blocks():
    config = make_config(server__kv_events_endpoint="tcp://127.0.0.1:*")
    service = EngineService.build(config, lm=tiny_lm(), max_running=1)
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(service.kv_events.publisher.endpoint)
        time.sleep(0.3)
        prompt = tuple(range(5, 5 + 40))  # two full pages of 16
        service.generate(GenerationRequest(prompt, 2), timeout=120)
        view, events = new_view(), []
        while sub.poll(1000):
            events += apply_payload(view, sub.recv_multipart()[2])
        stored = [e for e in events if e["type"] == "BlockStored"]
        assert {e["medium"] for e in stored} >= {"GPU", "CPU"}
        assert all(e["block_size"] == 16 for e in stored)
        assert sum(len(e["token_ids"]) for e in stored if e["medium"] == "GPU") >= 32
        assert service.kv_events_stats()["recorder"]["dropped_total"] == 0
    finally:
        sub.close()
        service.close()
    assert service.prefix_cache.tiered.ctx.index.observer is None


def test_kv_events_with_the_cache_off_are_refused_at_start():
    config = make_config(server__kv_events_endpoint="tcp://127.0.0.1:*", cache__enabled="false")
    with pytest.raises(ConfigError, match="kv_events_endpoint"):
        EngineService.build(config, lm=tiny_lm(), max_running=1)
