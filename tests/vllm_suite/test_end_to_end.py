"""kvtier's connector in real vLLM CPU engines, one fresh process per run.

The runs share one disk tier and one Redis server, in order: vLLM without the connector (the
reference output), a store run, a fresh-process load run (hits, a different ``cache_salt``,
Redis killed in the middle), a disk hit arriving while another request decodes, and a run
after every stored page on disk was corrupted. What the
model really computed is counted by a forward hook on its embedding, since vLLM's own hit
counters record what the connector claimed at admission.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import prompts, run_scenario

from redis_server import REDIS_SERVER, RedisServer

PROMPT_TOKENS = 300          # two full 128-token vLLM blocks and pages, and a partial one
MAX_TOKENS = 6
STORED = 256                 # full pages of each prompt
PROMPTS = prompts(3, PROMPT_TOKENS, seed=7)
A, B, C = ({"tokens": p} for p in PROMPTS)
A_OTHER_TENANT = {"tokens": PROMPTS[0], "salt": "tenant-b"}
D = {"tokens": prompts(1, PROMPT_TOKENS, seed=8)[0]}     # never stored before it runs
#: Prompts are stored after their step, on the connector's saver thread: wait for it.
DRAIN = {"action": {"drain_connector": 120}}

#: Six engine processes of ~25 s each on an idle 2-core machine; far more on a loaded one.
pytestmark = [pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed"),
              pytest.mark.timeout(3000)]


def _spec(model: Path, connector: dict[str, Any] | None, *steps: Any) -> dict[str, Any]:
    shaped = [s if isinstance(s, dict) else {"prompts": s, "max_tokens": MAX_TOKENS}
              for s in steps]
    return {"model": str(model), "connector": connector, "steps": shaped}


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("vllm-runs")
    server = RedisServer(work / "redis").start()
    try:
        tiers = {"disk_url": f"file://{work / 'disk'}", "remote_url": server.url(),
                 "host_pool_bytes": "64MiB", "remote_timeout_s": 0.5}
        out = {"reference": run_scenario(_spec(tiny_model, None, [A, B, C, A_OTHER_TENANT, D]),
                                         work)}
        out["store"] = run_scenario(_spec(tiny_model, tiers, [A, B], DRAIN), work)
        out["load"] = run_scenario(_spec(
            tiny_model, tiers, [A, A_OTHER_TENANT], {"action": {"kill_pid": server.process.pid}},
            [B, C]), work)
        beside = {"beside": {**D, "max_tokens": 40, "after": 3}, "prompts": [A],
                  "max_tokens": MAX_TOKENS}
        # The disk read may take longer than the default budget on a loaded CI machine: this
        # run checks where the hit lands, so it waits for the read whatever it takes.
        landing = dict(tiers, remote_url="", prefetch_policy="wait_complete")
        out["beside"] = run_scenario(_spec(tiny_model, landing, beside), work)
        _corrupt_disk_pages(work / "disk")
        out["corrupt"] = run_scenario(_spec(tiny_model, dict(tiers, remote_url=""), [A]), work)
        return out
    finally:
        server.stop()


def _corrupt_disk_pages(disk: Path) -> None:
    """Overwrite bytes in the middle of every stored page's payload."""
    import json

    meta = json.loads((disk / "kvtier-store.json").read_text())
    for segment in sorted((disk / "segments").glob("*.seg")):
        size = segment.stat().st_size
        with segment.open("r+b") as f:
            offset = meta["table_bytes"] + meta["record_bytes"] // 2
            while offset < size:
                f.seek(offset)
                f.write(b"\x5a" * 64)
                offset += meta["record_bytes"]


def _tokens(run: dict[str, Any], step: int = 0) -> list[list[int]]:
    return [r["tokens"] for r in run["steps"][step]]


def test_connector_does_not_change_greedy_output_of_a_store_run(runs):
    assert _tokens(runs["store"]) == _tokens(runs["reference"])[:2]
    assert runs["store"]["actions"][0]["done"]
    assert runs["store"]["connector"]["saved_tokens"] == 2 * STORED
    assert runs["store"]["connector"]["saves_queued"] == 2


def test_fresh_process_serves_stored_prompts_from_kvtier_with_identical_output(runs):
    load, reference = runs["load"], runs["reference"]
    first = load["steps"][0][0]
    assert first["tokens"] == reference["steps"][0][0]["tokens"]
    assert first["num_cached_tokens"] == STORED
    # the model ran only the uncached tail of the prompt, then one token per decode step
    assert first["computed_tokens"] == PROMPT_TOKENS - STORED + MAX_TOKENS - 1
    assert load["connector"]["claimed_tokens"] >= STORED
    # every layer of every load reached vLLM's blocks before a forward read them
    assert load["connector"]["load_layer_copies"] > 0
    assert load["connector"].get("load_layers_missed", 0) == 0


def test_a_different_cache_salt_gets_no_hit(runs):
    other = runs["load"]["steps"][0][1]
    assert other["num_cached_tokens"] == 0
    assert other["computed_tokens"] == PROMPT_TOKENS + MAX_TOKENS - 1
    assert other["tokens"] == runs["reference"]["steps"][0][3]["tokens"]


def test_requests_complete_with_identical_output_after_redis_is_killed(runs):
    after = runs["load"]["steps"][1]
    assert [r["tokens"] for r in after] == _tokens(runs["reference"])[1:3]
    assert after[0]["num_cached_tokens"] == STORED        # B: still served from the disk tier
    assert after[1]["computed_tokens"] == PROMPT_TOKENS + MAX_TOKENS - 1   # C: new, computed


def test_a_disk_hit_arriving_while_another_request_decodes_lands_beside_it(runs):
    """A fresh process: D decodes; A, stored on the disk tier only, arrives. The scheduling
    thread does not read the disk: A waits while its pages land (D keeps stepping), then is
    served whole, and both outputs are vLLM's own."""
    (hit, beside), reference = runs["beside"]["steps"][0], runs["reference"]["steps"][0]
    assert hit["tokens"] == reference[0]["tokens"]
    assert hit["num_cached_tokens"] == STORED
    assert beside["tokens"][:MAX_TOKENS] == reference[4]["tokens"]
    assert runs["beside"]["connector"]["lookups_deferred_landing"] == 1


def test_corrupted_pages_on_disk_are_recomputed_with_identical_output_and_counted(runs):
    run = runs["corrupt"]
    only = run["steps"][0][0]
    assert only["tokens"] == runs["reference"]["steps"][0][0]["tokens"]
    assert only["computed_tokens"] == PROMPT_TOKENS + MAX_TOKENS - 1
    assert run["connector"].get("claimed_tokens", 0) == 0
    assert run["connector"]["matched_tokens"] == STORED
    assert run["connector"]["unverified_or_missing_tokens"] == STORED
