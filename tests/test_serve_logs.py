"""The server's log lines, from plain snapshots: one per request and the periodic stats line."""

from __future__ import annotations

from types import SimpleNamespace

from cache_support import LAYOUT, make_cache
from kvtier.config import StoreConfig
from kvtier.engine.request import PrefillReport
from kvtier.serve.logs import changed, pages_by_tier, request_line, stats_line, tiers_summary
from kvtier.store.memory import MemoryStore


def _snap(prompt: int, completion: int, cached: dict, running: int = 0, queued: int = 0,
          pages: dict | None = None, ended: int = 0) -> dict:
    return {"requests": {"prompt_tokens_total": prompt, "completion_tokens_total": completion,
                         "cached_tokens_total": cached, "requests_total": {"stop": ended}},
            "scheduler": {"running": running, "queued": queued}, "pages": pages}


def test_request_line_names_tokens_by_tier_times_and_outcome():
    report = PrefillReport(prompt_tokens=481, cached_tokens=448)
    report.cached_by_tier.update(device=256, disk=192)
    line = request_line("cmpl-1", "stop", 481, report, 16, 0.0091, 0.0802)
    assert line == ("cmpl-1: stop, prompt 481 tokens (cached 448: device 256, disk 192), "
                    "generated 16, TTFT 9.1 ms, total 80.2 ms")
    assert "cached 0), generated 0, TTFT -" in request_line("r", "error", 5, None, 0, None, 0.1)


def test_stats_line_gives_interval_rates_hit_shares_and_pages():
    before = _snap(1000, 50, {"device": 100, "host": 0, "disk": 0, "remote": 0})
    after = _snap(3000, 250, {"device": 600, "host": 0, "disk": 500, "remote": 0}, running=2,
                  queued=1, pages={"device": 40, "host": 90, "disk": 300}, ended=4)
    line = stats_line(before, after, 4.0)
    assert line.startswith("prompt 500.0 tokens/s, generation 50.0 tokens/s, running 2, queued 1")
    assert "hit rate device 25.0%, host 0.0%, disk 25.0%, remote 0.0%" in line
    assert line.endswith("pages device 40, host 90, disk 300")


def test_stats_line_is_skipped_only_while_nothing_happens():
    idle = _snap(10, 1, {"device": 0}, pages={"device": 1})
    assert not changed(idle, idle)
    assert changed(idle, _snap(10, 1, {"device": 0}, running=1, pages={"device": 1}))
    assert changed(idle, _snap(10, 1, {"device": 0}, pages={"device": 2}))
    assert "hit rate device -" in stats_line(idle, idle, 1.0)


def test_pages_by_tier_reads_pools_from_the_index_and_stores_as_counted():
    stats = {"tiers": {"device": {"pages": 3}, "host": {"pages": 5}, "disk": {"pages": 1}},
             "stores": {"disk": {"pages": 700}}}
    assert pages_by_tier(stats) == {"device": 3, "host": 5, "disk": 700}


def test_tiers_summary_names_each_tier_from_the_facade_with_its_size_and_pages() -> None:
    disk = MemoryStore(LAYOUT.page_bytes)
    disk.write([bytes(32)], [bytes(LAYOUT.page_bytes)])
    with make_cache(device_pages=8, host_pages=16, stores={"disk": disk}) as cache:
        service = SimpleNamespace(prefix_cache=SimpleNamespace(tiered=cache),
                                  config=SimpleNamespace(store=StoreConfig(disk_url="memory://d")),
                                  lm=SimpleNamespace(device="cpu"))
        line = tiers_summary(service)
    assert line.startswith("tiers: device 8 pages (") and ", cpu)" in line
    assert "; host 16 pages (" in line and "disk memory://d: 1 pages found" in line
    assert line.endswith("remote off")
