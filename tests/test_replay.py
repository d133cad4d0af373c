"""Trace replay: reading traces, the offline bound, the replay through the real index, tiers.

Small hand-made and synthetic traces only; the one check against the real trace is skipped
when the file is not there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigError
from kvtier.replay import synthetic
from kvtier.replay.bound import offline_bound
from kvtier.replay.simulator import ReplayConfig, replay
from kvtier.replay.trace import Trace, TraceRequest, parse_lines, read_trace, write_trace

B = 4  # tokens per block in the hand-made traces
REAL_TRACE = Path(__file__).resolve().parents[2] / "shared/traces/mooncake_conversation.jsonl"


def req(t: int, *blocks: int, tokens: int | None = None) -> TraceRequest:
    return TraceRequest(t, len(blocks) * B if tokens is None else tokens, 1, tuple(blocks))


def trace_of(*requests: TraceRequest) -> Trace:
    return Trace(tuple(requests), B, "hand")


# ---- traces ------------------------------------------------------------------------------------
def test_trace_lines_come_back_in_timestamp_order():
    lines = ['{"timestamp": 5, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]}',
             "",
             '{"timestamp": 1, "input_length": 4, "output_length": 1, "hash_ids": [1]}']
    trace = parse_lines(lines, B)
    assert [r.timestamp_ms for r in trace] == [1, 5]
    assert trace.input_tokens == 12 and trace.unique_blocks() == 2


def test_bad_trace_line_is_refused_naming_the_line():
    with pytest.raises(ConfigError, match="line 2"):
        parse_lines(['{"timestamp": 0, "input_length": 4, "hash_ids": [1]}', '{"timestamp": 1}'])


def test_trace_round_trips_through_a_file(tmp_path):
    trace = trace_of(req(0, 1, 2), req(7, 1, 3, tokens=9))
    write_trace(tmp_path / "t.jsonl", trace.requests)
    assert read_trace(tmp_path / "t.jsonl", B).requests == trace.requests


def test_partial_last_block_serves_only_the_input_tokens():
    assert req(0, 1, 2, tokens=6).served_tokens(2, B) == 6
    assert req(0, 1, 2, tokens=6).served_tokens(1, B) == 4


def test_infinite_share_counts_prefix_hits_only():
    trace = trace_of(req(0, 1, 2), req(1, 1, 2, 3), req(2, 9, 2))
    assert trace.infinite_share() == pytest.approx(2 * B / (7 * B))


def test_trace_parts_split_requests_without_overlap():
    trace = trace_of(*(req(i, i) for i in range(7)))
    parts = [trace.part(i, 2) for i in range(2)]
    assert [len(p) for p in parts] == [3, 4]
    assert parts[0].requests + parts[1].requests == trace.requests


# ---- offline bound -----------------------------------------------------------------------------
def test_bound_keeps_the_block_used_soonest():
    # capacity 2: after [1,2] then [3,4], Belady keeps what [1,2] needs next, not [3,4]
    trace = trace_of(req(0, 1, 2), req(1, 3, 4), req(2, 1, 2), req(3, 3, 4))
    assert offline_bound(trace, 2).served_tokens == 2 * B


def test_bound_evicts_the_child_before_its_parent_on_a_tie():
    # after [3] arrives one of 1, 2 must go; both are next used by the last request, and
    # keeping the parent (1) still serves it, while keeping only the child (2) serves nothing
    trace = trace_of(req(0, 1, 2), req(1, 3), req(2, 3), req(3, 1, 2))
    assert offline_bound(trace, 2).served_tokens == 2 * B


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 1000), fraction=st.sampled_from((0.05, 0.2, 0.5)))
def test_bound_is_above_lru_and_below_infinite_capacity(seed, fraction):
    trace = synthetic.chat(synthetic.Shape(requests=150, duration_s=400, seed=seed))
    pages = max(int(trace.unique_blocks() * fraction), 64)
    lru = replay(trace, ReplayConfig(pages * 512)).served_share
    bound = offline_bound(trace, pages).share
    assert lru <= bound + 1e-12
    assert bound <= trace.infinite_share() + 1e-12


# ---- replay through the index -------------------------------------------------------------------
def test_repeated_request_is_served_from_the_device():
    result = replay(trace_of(req(0, 1, 2, 3), req(1, 1, 2, 3)), ReplayConfig(8 * B, block_tokens=B))
    assert result.served_tokens["device"] == 3 * B
    assert result.served_share == pytest.approx(0.5)


def test_lru_replay_evicts_the_least_recent_path():
    trace = trace_of(req(0, 1, 2), req(1, 3, 4), req(2, 5, 6), req(3, 1, 2), req(4, 5, 6))
    result = replay(trace, ReplayConfig(4 * B, block_tokens=B))
    assert result.served_tokens["device"] == 2 * B   # [1,2] was evicted, [5,6] was not
    assert result.evicted_pages["device"] == 4


def test_device_evictions_are_served_from_the_host_under_write_through():
    trace = trace_of(req(0, 1, 2), req(1, 3, 4), req(2, 1, 2))
    result = replay(trace, ReplayConfig(2 * B, 8 * B, block_tokens=B))
    assert result.served_tokens == {"device": 0, "host": 2 * B, "disk": 0}
    assert result.promoted_pages["host->device"] == 2
    assert result.written_pages["host"] == 4


def test_selective_write_copies_a_continued_request_whole_and_skips_one_offs():
    trace = trace_of(req(0, 1, 2), req(1, 1, 2, 3), req(2, 7, 8), req(3, 1, 2, 3))
    through = replay(trace, ReplayConfig(3 * B, 8 * B, 8 * B, block_tokens=B))
    selective = replay(trace, ReplayConfig(3 * B, 8 * B, 8 * B,
                                           write_policy="write_through_selective", block_tokens=B))
    assert through.written_pages["disk"] == 5
    assert selective.written_pages["disk"] == 3          # [1, 2, 3]: it continued [1, 2]
    assert selective.served_share == through.served_share  # the one-offs never came back


def test_selective_write_serves_a_returning_chain_that_the_device_dropped():
    # the device holds 3 pages: [1, 2, 3] is gone when its third turn comes
    trace = trace_of(req(0, 1, 2), req(1, 5, 6), req(2, 1, 2, 3), req(3, 7, 8), req(4, 1, 2, 3))
    result = replay(trace, ReplayConfig(3 * B, 8 * B, write_policy="write_through_selective",
                                        block_tokens=B))
    assert result.served_tokens["host"] == 3 * B         # the third turn reads [1, 2, 3]
    assert result.written_pages["host"] == 3             # [5, 6] and [7, 8] never went down


def test_pages_only_on_disk_land_on_the_host_first():
    trace = trace_of(req(0, 1, 2), req(1, 3, 4), req(2, 5, 6), req(3, 1, 2))
    result = replay(trace, ReplayConfig(2 * B, 2 * B, 8 * B, block_tokens=B))
    assert result.served_tokens["disk"] == 2 * B
    assert result.promoted_pages["disk->host"] == 2
    assert result.promoted_pages["disk->device"] == 2


def test_replay_refuses_a_device_smaller_than_a_block_and_a_mismatched_block_size():
    with pytest.raises(ConfigError):
        ReplayConfig(B - 1, block_tokens=B)
    with pytest.raises(ConfigError):
        replay(trace_of(req(0, 1)), ReplayConfig(1024, block_tokens=512))


@pytest.mark.parametrize("policy", ["lru", "lrfu"])
def test_multi_tier_replay_of_a_synthetic_workload_keeps_the_index_whole(policy):
    trace = synthetic.agent(synthetic.Shape(requests=200, duration_s=300))
    config = ReplayConfig(100 * 512, 300 * 512, 2000 * 512, policy=policy)
    result = replay(trace, config, timed=True)  # replay runs check_integrity at the end
    assert 0 < result.served_share <= trace.infinite_share() + 1e-12
    assert result.policy_timing["device"]["all"]["calls"] > 0
    assert len(result.per_request) == len(trace)


@pytest.mark.skipif(not REAL_TRACE.exists(), reason="the Mooncake trace is not present")
def test_lru_replay_reproduces_the_published_shares_of_the_real_trace():
    trace = read_trace(REAL_TRACE)
    for tokens, published in ((1_000_000, 0.054), (3_000_000, 0.138), (10_000_000, 0.291)):
        share = replay(trace, ReplayConfig(tokens)).served_share
        assert share == pytest.approx(published, abs=0.005), tokens


def test_lru_knowing_dead_pages_evicts_a_dead_leaf_before_an_older_live_one():
    from kvtier.replay.oracle import DeadFirstLRU

    # [1,2] returns at the end, [3,4] never does: plain LRU drops [1,2] (older), the oracle [3,4]
    trace = trace_of(req(0, 1, 2), req(1, 3, 4), req(2, 5, 6), req(3, 1, 2))
    for spread in (True, False):   # it reads the pages as the replay writes them, either way
        knows = DeadFirstLRU(trace, spread_ids=spread)
        config = ReplayConfig(4 * B, block_tokens=B, spread_ids=spread)
        result = replay(trace, config, policy_factory=lambda k=knows: k, progress=knows.advance)
        plain = replay(trace, config)
        assert result.served_tokens["device"] == 2 * B, spread
        assert plain.served_tokens["device"] == 0


def test_synthetic_workloads_are_deterministic_prefix_chains():
    for name in synthetic.GENERATORS:
        shape = synthetic.Shape(requests=120, duration_s=200, seed=3)
        first, again = synthetic.make(name, shape), synthetic.make(name, shape)
        assert first.requests == again.requests and len(first) == 120
        parent: dict[int, int] = {}
        for request in first:
            assert len(request.blocks) == -(-request.input_tokens // shape.block_tokens)
            for i, block in enumerate(request.blocks):
                assert parent.setdefault(block, request.blocks[i - 1] if i else -1) == (
                    request.blocks[i - 1] if i else -1)


def test_synthetic_chat_turns_extend_the_previous_prompt():
    trace = synthetic.chat(synthetic.Shape(requests=300, duration_s=600, seed=1))
    assert trace.infinite_share() > 0.2
    with pytest.raises(ConfigError):
        synthetic.make("nope")


def _rerun(log, policy):
    victims = []
    for method, args in log:
        out = getattr(policy, method)(*args)
        if method == "pop_victim":
            victims.append(out)
    return victims


def test_a_recorded_call_stream_replays_identically_on_a_fresh_policy():
    from kvtier.index.eviction import make_eviction_policy
    from kvtier.replay.timing import RecordingPolicy, time_calls

    trace = synthetic.rag(synthetic.Shape(requests=200, duration_s=300))
    recorder = RecordingPolicy(make_eviction_policy("lrfu"))
    replay(trace, ReplayConfig(200 * 512, policy="lrfu"), policy_factory=lambda: recorder)
    victims = _rerun(recorder.log, make_eviction_policy("lrfu"))
    assert victims and None not in victims
    assert victims == _rerun(recorder.log, make_eviction_policy("lrfu"))
    timing = time_calls(recorder.log, lambda: make_eviction_policy("lrfu"), repeats=2)
    assert timing["calls"] == len(recorder.log) and timing["us_per_call"] > 0


def test_spread_ids_are_distinct_pages_and_change_only_what_the_default_policy_samples():
    trace = synthetic.chat(synthetic.Shape(requests=400, duration_s=600, seed=5))
    ids = sorted({b for r in trace for b in r.blocks})
    spread = TraceRequest(0, len(ids) * B, 1, tuple(ids)).block_bytes(spread=True)
    pages = [spread[i:i + 4] for i in range(0, len(spread), 4)]
    assert len(set(pages)) == len(ids)                     # a bijection: no two ids collide
    assert [p[0] for p in pages[:64]] != sorted(p[0] for p in pages[:64])  # leading bytes mixed
    tokens = max(trace.unique_blocks() // 20, 2) * trace.block_tokens
    for policy in ("lru", "lrfu"):   # policies that do not sample serve exactly the same
        raw, mixed = (replay(trace, ReplayConfig(tokens, policy=policy, block_tokens=trace.block_tokens,
                                                 spread_ids=s)) for s in (False, True))
        assert mixed.served_tokens == raw.served_tokens
        assert mixed.evicted_pages == raw.evicted_pages
