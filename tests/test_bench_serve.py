"""``kvtier bench serve``: workloads keep their prefix structure, the summary's arithmetic, and a
run against a real server that reports throughput, latencies and the cached share per tier."""

from __future__ import annotations

import argparse
import json

from kvtier.bench.serve_load import RequestResult, summarize
from kvtier.bench.serve_workloads import conversations, multi_turn, random_prompts, shared_prefix
from kvtier.commands import bench_serve
from test_engine_support import make_config, running_server


def test_shared_prefix_groups_share_exactly_their_prefix():
    requests = shared_prefix(8, 3, 20, 5, 4, vocab=500)
    assert len({r.prompt[:20] for r in requests}) == 3
    assert all(r.prompt[:20] == requests[i % 3].prompt[:20] for i, r in enumerate(requests))
    assert len({r.prompt for r in requests}) == 8 and all(len(r.prompt) == 25 for r in requests)
    assert random_prompts(2, 7, 3, 500) == random_prompts(2, 7, 3, 500)   # seeded


def test_multi_turn_keeps_the_traces_prefix_chains_at_any_scale(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 0, "input_length": 1000, "output_length": 512, "hash_ids": [0, 1]},
            {"timestamp": 5, "input_length": 700, "output_length": 60, "hash_ids": [0, 9]},
            {"timestamp": 9, "input_length": 1400, "output_length": 10, "hash_ids": [0, 1, 2]}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    turns = multi_turn(trace, 10, block_tokens=8, max_output=5, vocab=500)
    assert len(turns) == 2                       # conversation 9 has one turn: left out
    first, second = turns
    assert len(first.prompt) == round(1000 * 8 / 512) and len(second.prompt) == 22
    assert second.prompt[:16] == first.prompt[:16]   # blocks 0 and 1 are shared
    assert first.max_tokens == 5 and second.max_tokens == 1


def test_conversations_resend_the_whole_history_turn_by_turn():
    requests = conversations(3, 4, system_len=10, user_len=5, reply_len=2, output_len=7,
                             vocab=500)
    assert len(requests) == 12 and all(r.max_tokens == 7 for r in requests)
    assert [r.tenant for r in requests[:4]] == ["conversation-0", "conversation-1",
                                                "conversation-2", "conversation-0"]
    for c in range(3):
        chat = [r.prompt for r in requests[c::3]]
        assert [len(p) for p in chat] == [10 + (t + 1) * 5 + t * 2 for t in range(4)]
        assert all(b[:len(a)] == a for a, b in zip(chat, chat[1:], strict=False))
    firsts = [r.prompt for r in requests[:3]]
    assert len({p[:10] for p in firsts}) == 1 and len({p[10:] for p in firsts}) == 3
    assert conversations(3, 4, 10, 5, 2, 7, 500) == requests                  # seeded


def test_summary_percentiles_throughput_and_cached_share():
    results = [RequestResult(True, 100, 10, 0.1, 1.0, [0.01] * 9, {"device": 50, "host": 10},
                             cached_tokens=60),
               RequestResult(True, 100, 10, 0.3, 1.0, [0.03] * 9, {"device": 0}),
               RequestResult(False, 100, error="HTTP 429")]
    out = summarize(results, 2.0)
    assert out["failed"] == 1 and out["errors"] == ["HTTP 429"]
    assert out["output_tokens_per_s"] == 10.0 and out["total_tokens_per_s"] == 110.0
    assert out["ttft_ms_p50"] in (100.0, 300.0) and out["ttft_ms_p99"] == 300.0
    assert abs(out["itl_ms_p99"] - 30.0) < 1e-9
    assert out["cached_share"]["device"] == 0.25 and out["cached_share"]["host"] == 0.05
    assert out["cached_tokens_share"] == 0.3 and out["requests_per_s"] == 1.0


def test_a_run_against_a_server_reports_hits_and_writes_json(tmp_path, capsys):
    args = argparse.Namespace(
        workload="shared-prefix", num_requests=6, concurrency=3, request_rate=None,
        input_len=4, output_len=5, groups=2, prefix_len=32, trace="", block_tokens=512,
        vocab=900, seed=0, api_key="", json=str(tmp_path / "out.json"), plot=None)
    with running_server(make_config()) as (_, url):
        args.url, args.baseline_url = url, None
        assert bench_serve.run(args) == 0
    result = json.loads((tmp_path / "out.json").read_text())
    run = result["runs"]["kvtier"]
    assert run["failed"] == 0 and run["generated_tokens"] == 30
    assert run["cached_share"]["device"] > 0 and run["ttft_ms_p50"] > 0
    assert "kvtier" in capsys.readouterr().out and "machine" in result


def test_every_token_chunk_is_timed_even_with_empty_text():
    from kvtier.bench import serve_load

    def chunk(text, finish=None):
        return ("data: " + json.dumps({"choices": [{"text": text, "finish_reason": finish}]})
                ).encode()
    lines = [chunk(""), chunk("a"), chunk(""), chunk("", "length"),
             b'data: {"choices": [], "usage": {"completion_tokens": 3, '
             b'"prompt_tokens_details": {"cached_tokens": 2}}}', b"data: [DONE]"]
    result = RequestResult(ok=True, prompt_tokens=4)
    serve_load._read_stream(iter(lines), result, 0.0)
    assert result.ttft_s is not None and len(result.itl_s) == 2
    assert result.completion_tokens == 3 and result.cached_tokens == 2
