"""kvtier's connector in real vLLM CPU engines at TP=2 and TP=1, sharing one disk tier.

In order: a TP=1 engine without the connector (the TP=1 reference); a TP=2 engine with it
stores prompt P and computes Q with kvtier kept out of it (the TP=2 references); a TP=1 engine
serves P from the pages the two ranks wrote and stores Q; a TP=2 engine serves both, Q from the
page a single rank wrote; and a TP=1 engine with vLLM's multiprocessing on (its default:
engine core and worker each in a process of their own) serves both. Each TP=2 rank runs in a
process of its own and copies its KV head through kvtier's shared staging pool. Greedy output
is compared with the reference of the same TP size, and what the model computed is counted by
a forward hook on rank 0's embedding.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import prompts, run_scenario

PROMPT_TOKENS = 300          # two full 128-token pages and a partial block
STORED = 256
MAX_TOKENS = 6
P, Q = ({"tokens": p} for p in prompts(2, PROMPT_TOKENS, seed=11))
Q_OFF = {**Q, "kvtier_off": True}

pytestmark = [pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                 reason="two vLLM CPU ranks need two cores"),
              pytest.mark.timeout(3000)]


def _spec(model: Path, connector: dict[str, Any] | None, tp: int, *prompt_list: Any):
    return {"model": str(model), "connector": connector, "tensor_parallel_size": tp,
            "prefix_caching": False,
            "steps": [{"prompts": list(prompt_list), "max_tokens": MAX_TOKENS}]}


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("vllm-tp")
    tiers = {"disk_url": f"file://{work / 'disk'}", "host_pool_bytes": "64MiB"}
    return {"reference": run_scenario(_spec(tiny_model, None, 1, P, Q), work),
            "tp2_store": run_scenario(_spec(tiny_model, tiers, 2, P, Q_OFF), work),
            "tp1_load": run_scenario(_spec(tiny_model, tiers, 1, P, Q), work),
            "tp2_load": run_scenario(_spec(tiny_model, tiers, 2, Q, P), work),
            "tp1_processes": run_scenario({**_spec(tiny_model, tiers, 1, P, Q),
                                           "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}},
                                          work)}


def _results(run: dict[str, Any]) -> list[dict[str, Any]]:
    return run["steps"][0]


def test_two_ranks_store_what_they_computed(runs):
    stats = runs["tp2_store"]["connector"]
    assert stats.get("saved_tokens") == STORED            # P only: Q kept kvtier out
    assert [r["computed_tokens"] for r in _results(runs["tp2_store"])] == \
        [PROMPT_TOKENS + MAX_TOKENS - 1] * 2


def test_a_tp1_engine_serves_pages_two_ranks_wrote_with_the_same_output(runs):
    p, q = _results(runs["tp1_load"])
    ref_p, ref_q = _results(runs["reference"])
    assert p["num_cached_tokens"] == STORED
    assert p["computed_tokens"] == PROMPT_TOKENS - STORED + MAX_TOKENS - 1
    assert p["tokens"] == ref_p["tokens"]
    assert q["num_cached_tokens"] == 0 and q["tokens"] == ref_q["tokens"]
    assert runs["tp1_load"]["connector"].get("load_errors", 0) == 0


def test_a_tp2_engine_serves_pages_one_rank_wrote_with_the_same_output(runs):
    q, p = _results(runs["tp2_load"])
    ref_p, ref_q_off = _results(runs["tp2_store"])
    for got, want in ((q, ref_q_off), (p, ref_p)):
        assert got["num_cached_tokens"] == STORED
        assert got["computed_tokens"] == PROMPT_TOKENS - STORED + MAX_TOKENS - 1
        assert got["tokens"] == want["tokens"]
    stats = runs["tp2_load"]["connector"]
    assert stats.get("claimed_tokens") == 2 * STORED and stats.get("load_errors", 0) == 0


def test_a_tp1_engine_with_its_worker_in_a_process_of_its_own_serves_both(runs):
    ref_p, ref_q = _results(runs["reference"])
    for got, want in zip(_results(runs["tp1_processes"]), (ref_p, ref_q), strict=True):
        assert got["num_cached_tokens"] == STORED
        assert got["computed_tokens"] == PROMPT_TOKENS - STORED + MAX_TOKENS - 1
        assert got["tokens"] == want["tokens"]
