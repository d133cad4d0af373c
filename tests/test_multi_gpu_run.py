"""The multi-rank run of ``benchmarks/multi_gpu/multi_gpu.py`` on the CPU (gloo): TP=2 ranks store their
heads, TP=1 and TP=4 ranks load byte-identical slices and the same greedy tokens, ranks with
different local hits agree on the minimum, and a rank that dies leaves the others failing fast."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "multi_gpu"))

multi_gpu = pytest.importorskip("multi_gpu")

PAGE = 8
PROMPT = 5 * PAGE + 3
TIMEOUT_S = 15.0


def test_tp2_pages_load_on_tp1_and_tp4_and_ranks_agree(tmp_path: Path) -> None:
    opts = {"backend": "gloo", "prompts": 2, "prompt_tokens": PROMPT, "page_size": PAGE,
            "greedy_tokens": 4, "pg_timeout_s": TIMEOUT_S, "threads": 1, "seed": 3,
            "start_method": "fork", "work_dir": str(tmp_path),
            "shape": {"layers": 2, "hidden": 64, "kv_heads": 8, "head_dim": 8, "mlp": 128}}
    result = multi_gpu.run_experiment(opts, writer=2)
    write, tp1, tp4, agree = result["runs"]
    assert [run["world"] for run in result["runs"]] == [2, 1, 4, 2]
    assert all(run["hung"] == [] for run in result["runs"])
    assert sum(r["written_pages"] for r in write["ranks"]) == 2 * 2 * (PROMPT // PAGE)
    assert [r["heads"] for r in tp4["ranks"]] == [[0, 2], [2, 4], [4, 6], [6, 8]]
    for rank in tp1["ranks"] + tp4["ranks"]:
        assert [p["hit_tokens"] for p in rank["prompts"]] == [PROMPT // PAGE * PAGE] * 2
        assert all(p["kv_identical"] and p["greedy_match"] for p in rank["prompts"])
    # the greedy tokens are the model's, whichever world loaded the KV
    assert tp1["ranks"][0]["prompts"][0]["greedy"] == tp4["ranks"][3]["prompts"][0]["greedy"]
    survivor, killed = agree["ranks"]
    assert killed["local_pages"] == 2 and survivor["local_pages"] == 5
    assert survivor["hit_tokens"] == killed["hit_tokens"] == 2 * PAGE
    assert survivor["loaded_tokens"] == killed["loaded_tokens"] == 2 * PAGE
    assert survivor["calls"] == killed["calls"]
    assert agree["exitcodes"][1] == 3 and "after_kill_s" not in killed
    assert survivor["after_kill"] != "returned" and survivor["after_kill_s"] < TIMEOUT_S
    assert all(result["checks"].values()), result["checks"]
