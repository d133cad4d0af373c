"""The shared staging pool of vLLM workers in their own processes, and each rank's KV heads."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest
import torch

from kvtier.errors import ConfigError, LayoutMismatch
from kvtier.integrations.vllm.runtime import ModelShape
from kvtier.integrations.vllm.shared_pool import PoolRef, SharedPool, attach, remove_stale
from kvtier.layout import KVLayout
from kvtier.memory.device_pool import DevicePool

SHAPE = (2, 2, 4, 8, 2, 4)          # layers, K|V, pages, page size, heads, head dim


def _fill_in_child(ref: PoolRef) -> None:
    pool = attach(ref)
    pool[1, 0, 3] = 7.0


def test_another_process_writes_into_the_same_bytes(tmp_path: Path):
    pool = SharedPool("engine-a", SHAPE, torch.float32, directory=tmp_path)
    try:
        child = multiprocessing.get_context("spawn").Process(target=_fill_in_child,
                                                             args=(pool.ref,))
        child.start()
        child.join(60)
        assert child.exitcode == 0
        assert bool((pool.tensor[1, 0, 3] == 7.0).all())
        assert float(pool.tensor.sum()) == 7.0 * 8 * 2 * 4
    finally:
        pool.close()
    assert not Path(pool.ref.path).exists()


def test_a_mapping_of_the_wrong_size_is_refused(tmp_path: Path):
    pool = SharedPool("engine-b", SHAPE, torch.float32, directory=tmp_path)
    try:
        with pytest.raises(ConfigError, match="bytes"):
            attach(PoolRef(pool.ref.path, (2, 2, 5, 8, 2, 4), "float32"))
    finally:
        pool.close()


def test_a_pool_larger_than_the_free_space_is_refused_naming_the_setting(tmp_path: Path):
    free = os.statvfs(tmp_path)
    pages = free.f_bavail * free.f_frsize // (8 * 2 * 4 * 4 * 4) + 1024
    with pytest.raises(ConfigError, match="cache.device_pages"):
        SharedPool("engine-c", (2, 2, pages, 8, 2, 4), torch.float32, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_pools_of_ended_processes_are_removed(tmp_path: Path):
    child = multiprocessing.get_context("spawn").Process(target=int)
    child.start()
    child.join(60)
    dead = tmp_path / f"kvtier-vllm-{child.pid}-old.pool"
    dead.write_bytes(b"x")
    live = tmp_path / f"kvtier-vllm-{os.getpid()}-mine.pool"
    live.write_bytes(b"x")
    assert remove_stale(tmp_path) == [dead]
    assert live.exists() and not dead.exists()


def test_a_device_pool_over_a_tensor_checks_its_layout():
    layout = KVLayout(2, 2, 4, "float32", 8)
    kv = torch.zeros(SHAPE)
    pool = DevicePool.over(layout, kv)
    assert pool.num_pages == 4 and pool.kv.data_ptr() == kv.data_ptr()
    with pytest.raises(LayoutMismatch):
        DevicePool.over(layout, torch.zeros(SHAPE, dtype=torch.float16))
    with pytest.raises(LayoutMismatch):
        DevicePool.over(KVLayout(2, 4, 4, "float32", 8), kv)


def _shape(kv_heads: int, tp: int) -> ModelShape:
    return ModelShape("m", ("l0",), kv_heads, 64, "float32", 16,
                      rank_kv_heads=max(1, kv_heads // tp), tp_size=tp)


@pytest.mark.parametrize(("kv_heads", "tp", "heads", "writers"), [
    (8, 1, [(0, 8)], [0]),
    (8, 2, [(0, 4), (4, 8)], [0, 1]),
    (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)], [0, 1, 2, 3]),
    (2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)], [0, 2]),     # each head on two ranks
    (1, 2, [(0, 1), (0, 1)], [0]),
])
def test_each_rank_keeps_vllms_share_of_the_heads(kv_heads, tp, heads, writers):
    shape = _shape(kv_heads, tp)
    assert [shape.rank_heads(r) for r in range(tp)] == heads
    assert [r for r in range(tp) if shape.writes_heads(r)] == writers
