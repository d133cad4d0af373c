"""The server starts and serves with broken stores, and says so: a disk directory with a garbled
manifest is moved aside and an empty store opens there, an unreachable Redis leaves the remote
tier off (the start's tiers line says so); ``/health`` answers 200 "degraded" naming the tier
and the reason, ``/metrics`` has ``kvtier_store_up`` 0 for it, and a disk directory removed
under the running server shows in ``/health`` within 10 s."""

from __future__ import annotations

import shutil
import time

import httpx

from kvtier.serve.logs import tiers_summary
from kvtier.store.file.segment import MANIFEST
from redis_server import free_port
from test_engine_support import make_config, running_server


def test_broken_stores_leave_the_server_serving_and_health_says_why(tmp_path) -> None:
    disk = tmp_path / "disk"
    (disk / "segments").mkdir(parents=True)
    (disk / MANIFEST).write_text("garbled")
    config = make_config(store__disk_url=f"file://{disk}", store__disk_min_free_bytes=0,
                         store__remote_url=f"redis://127.0.0.1:{free_port()}/0",
                         store__remote_timeout_s=0.2)
    with running_server(config) as (service, url):
        summary = service.scheduler.call_soon(lambda: tiers_summary(service)).result(30)
        assert "remote redis://127.0.0.1:" in summary
        assert "off (unavailable; retried in the background)" in summary
        body = {"model": "tiny-llama", "prompt": "x " * 40, "max_tokens": 2, "temperature": 0}
        for _ in range(2):
            httpx.post(url + "/v1/completions", json=body, timeout=60).raise_for_status()
        health = httpx.get(url + "/health")
        assert health.status_code == 200
        answer = health.json()
        assert answer["status"] == "degraded"
        remote, on_disk = answer["tiers"]["remote"], answer["tiers"]["disk"]
        assert remote["state"] == "off" and "unavailable" in remote["problems"]
        assert on_disk["state"] == "on" and on_disk["events_total"]["set_aside"] == 1
        assert [p.name.split("-")[0] for p in tmp_path.iterdir()
                if p.name.startswith("disk.")] == ["disk.corrupt"]
        metrics = httpx.get(url + "/metrics").text
        assert 'kvtier_store_up{backend="redis",tier="remote"} 0.0' in metrics
        assert 'kvtier_store_up{backend="file",tier="disk"} 1.0' in metrics
        shutil.rmtree(disk)
        start = time.monotonic()
        while time.monotonic() - start < 10.0:
            lost = httpx.get(url + "/health").json()["tiers"]["disk"]["events_total"].get("lost")
            if lost:
                break
            time.sleep(0.2)
        assert lost == 1, "the removed directory did not show in /health within 10 s"
        assert (disk / MANIFEST).exists()  # an empty store opened in its place
        httpx.post(url + "/v1/completions", json=body, timeout=60).raise_for_status()
