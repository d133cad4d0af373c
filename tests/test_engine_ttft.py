"""``kvtier bench ttft`` end to end on the tiny model, and its goal verdicts."""

from __future__ import annotations

import json

from kvtier.bench.ttft_report import goals
from kvtier.cli import main


def test_bench_ttft_writes_json_table_and_plot(tmp_path, capsys):
    out = tmp_path / "ttft.json"
    code = main(["bench", "ttft", "--model", "tiny-llama", "--device", "cpu",
                 "--prefix-tokens", "64,128", "--tiers", "recompute,device,host,disk,disk-load",
                 "--repeats", "1", "--suffix-tokens", "8", "--page-size", "16",
                 "--host-pool-bytes", "8MiB", "--cache.device_pages", "64",
                 "--controller.min_prefetch_tokens", "0", "--prefetch-policy", "wait_complete",
                 "--no-progress",
                 "--disk", f"file://{tmp_path}/disk", "--json", str(out),
                 "--plot", str(tmp_path / "ttft.png")])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "ttft" and result["machine"]["cpus"]
    cells = {(r["tier"], r["prefix_tokens"]) for r in result["rows"]}
    assert cells == {(t, n) for t in ("recompute", "device", "host", "disk", "disk-load")
                     for n in (64, 128)}
    for row in result["rows"]:
        if row["tier"] != "recompute":
            assert row["cached_tokens"] == row["prefix_tokens"], row
            assert row["cached_by_tier"][{"disk-load": "disk"}.get(row["tier"], row["tier"])] > 0
    assert [m["prefix_tokens"] for m in result["miss_path"]] == [64, 128]
    assert (tmp_path / "ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "miss path" in (tmp_path / "ttft.txt").read_text()
    assert "speedup" in capsys.readouterr().out


def test_a_redis_tier_needs_a_redis_url(capsys):
    code = main(["bench", "ttft", "--model", "tiny-llama", "--device", "cpu", "--tiers", "redis",
                 "--no-progress"])
    assert code == 2 and "a redis:// URL" in capsys.readouterr().err


def _row(tier, n, ttft_s, recompute_s):
    return {"tier": tier, "prefix_tokens": n, "ttft_s": ttft_s, "recompute_s": recompute_s,
            "ratio_to_recompute": ttft_s / recompute_s}


def test_goal_verdicts_follow_the_issue_thresholds():
    summary = {"rows": [_row("host", 32768, 0.1, 1.4), _row("host", 4096, 0.02, 0.12),
                        _row("disk", 16384, 0.4, 0.6), _row("disk-load", 16384, 0.5, 0.6)],
               "miss_path": [{"prefix_tokens": 4096, "overhead": 0.01},
                             {"prefix_tokens": 1024, "overhead": 0.05}]}
    verdicts = {g["goal"]: g["met"] for g in goals(summary)}
    assert verdicts == {
        "host hit at 32768 tokens <= 1/12 of recompute": True,    # 0.071
        "host hit at 4096 tokens <= 1/8 of recompute": False,     # 0.167
        "miss-path overhead at 4096 tokens <= 2%": True,
        "miss-path overhead at 1024 tokens <= 2%": False,
        "disk hybrid at 16384 tokens beats pure load and recompute": True,
    }
