"""Concurrent callers, a restart with the disk kept, a remote tier, and SGLang's own callers."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from types import SimpleNamespace

import pytest
from sglang_helpers import fill_random, make_pool, names, page_bytes, page_slots


def test_concurrent_callers_each_get_their_own_pages_back(backends, disk_url):
    pool = make_pool("mha", "page_first", heads=4, head_dim=64, pages=64)
    backend = backends(pool, disk_url, staging_bytes=2 * 8192)  # 2-page staging: many chunks
    fill_random(pool, seed=20)
    groups = [list(range(t * 8, t * 8 + 8)) for t in range(4)]
    expected = {p: page_bytes(pool, p) for g in groups for p in g}
    failures: list[str] = []

    def worker(t: int) -> None:
        try:
            keys = names(8, tag=f"t{t}")
            if not all(backend.batch_set_v1(keys, page_slots(pool, groups[t]))):
                failures.append(f"thread {t}: write refused")
            landing = [p + 32 for p in groups[t]]
            for round_ in range(6):
                if backend.batch_get_v1(keys, page_slots(pool, landing)) != [True] * 8:
                    failures.append(f"thread {t} round {round_}: miss")
                for src, dst in zip(groups[t], landing, strict=True):
                    if page_bytes(pool, dst) != expected[src]:
                        failures.append(f"thread {t} round {round_}: page {src} differs")
        except BaseException as exc:  # surfaced below
            failures.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not failures, failures[:5]


def test_restarted_backend_serves_pages_from_the_kept_disk(backends, disk_url):
    pool = make_pool("mha", "page_head")
    first = backends(pool, disk_url)
    fill_random(pool, seed=21)
    keys = names(5)
    expected = [page_bytes(pool, p) for p in range(5)]
    assert all(first.batch_set_v1(keys, page_slots(pool, list(range(5)))))
    first.close()
    fresh_pool = make_pool("mha", "page_head")
    second = backends(fresh_pool, disk_url)
    assert second.batch_exists(keys) == 5
    assert all(second.batch_get_v1(keys, page_slots(fresh_pool, list(range(10, 15)))))
    assert [page_bytes(fresh_pool, p) for p in range(10, 15)] == expected


def test_storage_metrics_report_pages_of_each_call_since_the_last_report(backends, disk_url):
    pool = make_pool("mha", "page_first")
    backend = backends(pool, disk_url)
    keys = names(3)
    assert all(backend.batch_set_v1(keys, page_slots(pool, [0, 1, 2])))
    assert backend.batch_get_v1(keys[:2], page_slots(pool, [4, 5])) == [True, True]
    metrics = backend.get_stats()
    assert metrics.backup_pgs == [3] and metrics.prefetch_pgs == [2]
    assert len(metrics.prefetch_bandwidth) == 1 and metrics.prefetch_bandwidth[0] > 0
    assert backend.get_stats().prefetch_pgs == []


def test_sglang_controller_paths_load_and_store_through_the_backend(backends, disk_url):
    from sglang.srt.managers.cache_controller import HiCacheController

    pool = make_pool("mha", "layer_first")
    backend = backends(pool, disk_url)
    fill_random(pool, seed=22)
    ctrl = SimpleNamespace(storage_backend=backend, storage_host_pool=pool,
                           page_size=pool.page_size)
    op = SimpleNamespace(request_id="r1", is_terminated=lambda: False)
    keys = names(4)
    expected = [page_bytes(pool, p) for p in range(4)]
    assert HiCacheController._page_set_zero_copy(ctrl, keys[:2], page_slots(pool, [0, 1]))
    assert HiCacheController._generic_page_set(ctrl, keys[2:], page_slots(pool, [2, 3]))
    pool.kv_buffer.zero_()
    got = HiCacheController._page_get_zero_copy(ctrl, op, keys, page_slots(pool, [8, 9, 10, 11]))
    assert got == 4
    assert [page_bytes(pool, p) for p in (8, 9, 10, 11)] == expected
    pool.kv_buffer.zero_()
    partial = names(2) + names(2, tag="missing")
    got = HiCacheController._generic_page_get(ctrl, op, partial, page_slots(pool, [4, 5, 6, 7]))
    assert got == 2 and [page_bytes(pool, p) for p in (4, 5)] == expected[:2]


@pytest.fixture
def redis_url(tmp_path):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("needs a redis-server binary (scripts/install_system_deps.sh installs it)")
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


def test_pages_only_in_redis_load_and_are_promoted_to_disk(backends, tmp_path, redis_url):
    pool = make_pool("mha", "page_first")
    writer = backends(pool, f"file://{tmp_path / 'disk-a'}", remote_url=redis_url)
    fill_random(pool, seed=23)
    keys = names(3)
    expected = [page_bytes(pool, p) for p in range(3)]
    assert all(writer.batch_set_v1(keys, page_slots(pool, [0, 1, 2])))
    other_pool = make_pool("mha", "page_first")
    reader = backends(other_pool, f"file://{tmp_path / 'disk-b'}", remote_url=redis_url)
    assert reader.stats()["tiers"]["disk"]["pages"] == 0
    assert reader.batch_exists(keys) == 3
    assert all(reader.batch_get_v1(keys, page_slots(other_pool, [5, 6, 7])))
    assert [page_bytes(other_pool, p) for p in (5, 6, 7)] == expected
    assert reader.stats()["tiers"]["disk"]["pages"] == 3


def test_storing_pages_the_disk_already_holds_writes_nothing(backends, disk_url):
    pool = make_pool("mha", "page_first")
    backend = backends(pool, disk_url)
    fill_random(pool, seed=24)
    keys = names(4)
    assert all(backend.batch_set_v1(keys[:2], page_slots(pool, [0, 1])))
    written = backend.stats()["tiers"]["disk"]["bytes_written"]
    assert all(backend.batch_set_v1(keys, page_slots(pool, [0, 1, 2, 3])))
    page = backend.describe()["page_bytes"]
    assert backend.stats()["tiers"]["disk"]["bytes_written"] == written + 2 * page
