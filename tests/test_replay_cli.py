"""``kvtier bench replay``: one run and the whole study, on small synthetic workloads."""

from __future__ import annotations

import json

from kvtier.cli import main
from kvtier.replay import study, synthetic


def test_bench_replay_prints_shares_and_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main(["bench", "replay", "--synthetic", "rag", "--limit", "300", "--device-tokens",
                 "200k", "--host-tokens", "400k", "--disk-tokens", "2M", "--policy", "lrfu",
                 "--no-progress", "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "offline bound" in text and "disk" in text
    data = json.loads(out.read_text())
    assert data["result"]["config"]["policy"] == "lrfu"
    assert 0 < data["result"]["served_share"] <= data["offline_bound"]["share"]
    assert "machine" in data


def test_bench_replay_refuses_an_unknown_policy(capsys):
    assert main(["bench", "replay", "--synthetic", "chat", "--policy", "nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_study_writes_json_table_and_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(study, "CURVE_TOKENS", (100_000, 400_000))
    monkeypatch.setattr(study, "HALF_TOKENS", (200_000,))
    monkeypatch.setattr(study, "PUBLISHED_LRU", {100_000: 0.1})
    monkeypatch.setattr(study, "TIER_CONFIGS", ((50_000, 100_000, 400_000),))
    shape = synthetic.Shape(requests=150, duration_s=300)
    data = study.run_study(synthetic.chat(shape), tmp_path, progress=False, shape=shape)
    for name in ("replay_study.json", "replay_study.txt", "replay_served_vs_capacity.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert {row["tokens"] for row in data["curve"]} == {100_000, 400_000}
    assert all(row["lru"] <= row["bound"] + 1e-12 for row in data["curve"])
    # the default policy against LRU on both halves (every curve capacity) and on every
    # synthetic workload (every margin fraction)
    margin = data["margin"]
    per_trace: dict[str, int] = {}
    for row in margin:
        per_trace[row["trace"]] = per_trace.get(row["trace"], 0) + 1
        assert row["margin"] == row["default"] - row["lru"]
    assert len(per_trace) == 2 + len(synthetic.GENERATORS)
    assert sorted(set(per_trace.values())) == sorted({len(study.CURVE_TOKENS),
                                                      len(study.MARGIN_FRACTIONS)})
    out = capsys.readouterr().out
    assert "Prefill GPU time saved" in out and "Default policy less LRU" in out
