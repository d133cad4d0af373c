"""The transfer path on a CUDA device: kernels reading and writing pinned host memory directly.

Random data, destinations poisoned with other random bytes before each run, and every byte of
both pools compared with a CPU oracle. Skipped without CUDA (see conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.layout import KVLayout
from kvtier.transfer import CopyEngine
from kvtier.transfer.kernels import KernelConfig, launch_copy
from kvtier.transfer.plan import device_geometry, host_geometry, make_plan
from kvtier.transfer.reference import reference_copy
from transfer_support import OPEN_DEVICE_HOST_POOLS, make_pools, snapshot

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _close_host_pools():
    yield
    torch.cuda.synchronize()
    while OPEN_DEVICE_HOST_POOLS:
        OPEN_DEVICE_HOST_POOLS.pop().close()

# Parts of 64 KiB (16-byte access), 90 B (2-byte), 96 B (16-byte, one ragged block), 33 KiB
# fp32 MLA (not a power of two), 7 B fp8 (1-byte).
LAYOUTS = {
    "bf16_64k": KVLayout(4, 8, 128, "bfloat16", 32),
    "fp16_90b": KVLayout(3, 3, 5, "float16", 3),
    "fp8_96b": KVLayout(2, 2, 16, "float8_e4m3fn", 3),
    "fp32_mla_33k": KVLayout(2, 1, 132, "float32", 64, mla=True),
    "fp8_7b": KVLayout(2, 1, 7, "float8_e5m2", 1),
}


def _random_batch(seed: int, src_pages: int, dst_pages: int, n: int) -> tuple[list, list]:
    rng = np.random.default_rng(seed)
    return list(rng.integers(0, src_pages, n)), list(rng.permutation(dst_pages)[:n])


def _check_against_oracle(layout: KVLayout, host_layout: str, direction: str,
                          layers: range | None, config: KernelConfig | None = None) -> None:
    dp, hp = 40, 48
    dev, host = make_pools(layout, dp, hp, host_layout, device="cuda", seed=21)
    want_dev, want_host = make_pools(layout, dp, hp, host_layout, device="cpu", seed=21)
    src_n, dst_n = (hp, dp) if direction == "load" else (dp, hp)
    src, dst = _random_batch(5, src_n, dst_n, 33)
    dg, hg = device_geometry(layout, dp), host_geometry(layout, hp, host_layout)
    plan = make_plan(direction, *((hg, dg) if direction == "load" else (dg, hg)), src, dst, layers)
    assert host.pin_method == "registered"
    launch_copy(plan, dev.kv, host.buffer, config)
    torch.cuda.synchronize()
    reference_copy(plan, want_dev.kv, want_host.buffer, host_layout)
    got, want = snapshot(dev, host), snapshot(want_dev, want_host)
    assert torch.equal(got[0], want[0]), "device pool differs"
    assert torch.equal(got[1], want[1]), "host pool differs"


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("direction", ["load", "store"])
def test_gpu_kernel_matches_oracle_every_byte(name: str, host_layout: str, direction: str) -> None:
    _check_against_oracle(LAYOUTS[name], host_layout, direction, None)


@pytest.mark.parametrize("direction", ["load", "store"])
def test_gpu_kernel_moves_only_a_layer_range(direction: str) -> None:
    _check_against_oracle(LAYOUTS["bf16_64k"], "layer_first", direction, range(1, 3))


@pytest.mark.parametrize("config", [KernelConfig(max_programs=1), KernelConfig(block_bytes=1024),
                                    KernelConfig(block_bytes=65536, num_warps=8)])
def test_gpu_kernel_is_correct_for_every_launch_shape(config: KernelConfig) -> None:
    _check_against_oracle(LAYOUTS["bf16_64k"], "page_first", "load", None, config)
    _check_against_oracle(LAYOUTS["fp16_90b"], "page_first", "store", None, config)


def test_gpu_kernel_reads_torch_pinned_memory_too() -> None:
    layout = LAYOUTS["bf16_64k"]
    dev, host = make_pools(layout, 8, 8, "page_first", device="cuda", seed=3)
    pinned = torch.empty(host.buffer.numel(), dtype=torch.uint8, pin_memory=True)
    pinned.copy_(host.buffer)
    plan = make_plan("load", host_geometry(layout, 8, "page_first"), device_geometry(layout, 8),
                     [7, 2, 5], [0, 6, 1])
    launch_copy(plan, dev.kv, pinned)
    want = dev.kv.cpu()
    reference_copy(plan, want, pinned, "page_first")
    assert torch.equal(dev.kv.cpu().view(torch.uint8), want.view(torch.uint8))


def test_gpu_pageable_host_memory_is_refused() -> None:
    layout = LAYOUTS["fp16_90b"]
    dev, _ = make_pools(layout, 4, 4, "page_first", device="cuda")
    pageable = torch.zeros(4 * layout.page_bytes, dtype=torch.uint8)
    plan = make_plan("load", host_geometry(layout, 4, "page_first"), device_geometry(layout, 4),
                     [0], [0])
    try:
        launch_copy(plan, dev.kv, pageable)
    except ValueError as exc:
        assert "pinned" in str(exc)
        return
    # Only where the device reads pageable memory through the host's page tables.
    torch.cuda.synchronize()
    assert int(dev.kv.view(torch.uint8)[:, :, 0].max()) == 0


def test_gpu_engine_store_sees_kv_written_on_the_compute_stream() -> None:
    layout = LAYOUTS["bf16_64k"]
    dev, host = make_pools(layout, 16, 16, "page_first", device="cuda", seed=4)
    engine = CopyEngine(dev, host)
    torch.cuda._sleep(20_000_000)  # keep the compute stream busy so ordering matters
    dev.kv[:, :, 5].fill_(3.0)
    ticket = engine.store([5], [9])
    assert ticket.wait(timeout=30.0)
    stored = host.page(9).view(torch.bfloat16)
    assert bool((stored == 3.0).all())


def test_gpu_engine_load_then_stream_wait_orders_the_consumer() -> None:
    layout = LAYOUTS["bf16_64k"]
    dev, host = make_pools(layout, 16, 16, "layer_first", device="cuda", seed=6)
    engine = CopyEngine(dev, host)
    host.shaped()[:, 2].view(torch.bfloat16).fill_(7.0)
    ticket = engine.load_layerwise([2], [11])
    sums = []
    for layer in range(layout.num_layers):
        ticket.stream_wait(layer=layer)
        sums.append(dev.kv[layer, :, 11].float().sum())
    expected = 7.0 * layout.layer_bytes / 2
    assert all(float(s) == expected for s in sums)
    assert ticket.wait(timeout=30.0) and ticket.is_done()


def test_gpu_engine_duplex_load_and_store_are_both_correct() -> None:
    layout = LAYOUTS["bf16_64k"]
    dev, host = make_pools(layout, 64, 64, "page_first", device="cuda", seed=8)
    want_dev, want_host = make_pools(layout, 64, 64, "page_first", seed=8)
    half = KernelConfig(max_programs=132)
    engine = CopyEngine(dev, host, load_config=half, store_config=half)
    load = engine.load(list(range(0, 32)), list(range(32, 64)))
    store = engine.store(list(range(0, 32)), list(range(32, 64)))
    assert load.wait(30.0) and store.wait(30.0)
    oracle = CopyEngine(want_dev, want_host)
    oracle.load(list(range(0, 32)), list(range(32, 64)))
    oracle.store(list(range(0, 32)), list(range(32, 64)))
    got, want = snapshot(dev, host), snapshot(want_dev, want_host)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_gpu_bad_ids_raise_before_anything_is_launched() -> None:
    layout = LAYOUTS["fp16_90b"]
    dev, host = make_pools(layout, 4, 4, "page_first", device="cuda")
    before = snapshot(dev, host)
    with pytest.raises(IndexError):
        CopyEngine(dev, host).load([0, 4], [1, 2])
    after = snapshot(dev, host)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


_COMPILE_SCRIPT = textwrap.dedent("""
    import torch
    from kvtier.layout import KVLayout
    from kvtier.transfer.kernels import launch_copy
    from kvtier.transfer.plan import device_geometry, host_geometry, make_plan
    layout = KVLayout(2, 2, 16, "bfloat16", 5)
    dev = torch.zeros(2, 2, 4, 5, 2, 16, dtype=torch.bfloat16, device="cuda")
    host = torch.full((4 * layout.page_bytes,), 9, dtype=torch.uint8).pin_memory()
    plan = make_plan("load", host_geometry(layout, 4, "page_first"), device_geometry(layout, 4),
                     [0, 1, 2, 3], [3, 2, 1, 0])
    launch_copy(plan, dev, host)
    torch.cuda.synchronize()
    assert bool((dev.view(torch.uint8) == 9).all())
""")


def test_gpu_processes_compiling_at_once_share_one_cache(tmp_path: Path) -> None:
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("TRITON_CACHE_MANAGER", None)
    env.pop("TRITON_INTERPRET", None)
    procs = [subprocess.Popen([sys.executable, "-c", _COMPILE_SCRIPT], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for _ in range(6)]
    outputs = [p.communicate(timeout=240)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0] * 6, "\n".join(outputs)
    entries = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert entries and all(not c.name.startswith("tmp") for e in entries for c in e.iterdir())
    assert list((tmp_path / ".kvtier-tmp").iterdir()) == []


@pytest.mark.parametrize("layers", [None, range(1, 3)])
def test_gpu_copy_engine_path_matches_the_kernels_in_duplex(layers) -> None:
    layout = LAYOUTS["bf16_64k"]  # pages of 1 MiB; 2.5 MiB of staging: the batch goes in chunks
    dev, host = make_pools(layout, 64, 64, "page_first", device="cuda", seed=12)
    want_dev, want_host = make_pools(layout, 64, 64, "page_first", seed=12)
    engine = CopyEngine(dev, host, path="copy_engine", staging_bytes=5 * layout.page_bytes // 2)
    assert engine.path == "copy_engine", engine.stats().get("path_fallback")
    torch.cuda._sleep(20_000_000)  # the compute stream is busy: the store must wait for it
    dev.kv[:, :, 3].fill_(5.0)
    want_dev.kv[:, :, 3].fill_(5.0)
    load = engine.load(list(range(0, 32)), list(range(32, 64)), layers=layers)
    store = engine.store(list(range(0, 32)), list(range(32, 64)), layers=layers)
    assert load.wait(30.0) and store.wait(30.0)
    oracle = CopyEngine(want_dev, want_host)
    oracle.load(list(range(0, 32)), list(range(32, 64)), layers=layers)
    oracle.store(list(range(0, 32)), list(range(32, 64)), layers=layers)
    got, want = snapshot(dev, host), snapshot(want_dev, want_host)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_gpu_copy_engine_path_layerwise_orders_the_consumer() -> None:
    layout = LAYOUTS["bf16_64k"]
    dev, host = make_pools(layout, 16, 16, "page_first", device="cuda", seed=13)
    engine = CopyEngine(dev, host, path="copy_engine", staging_bytes=layout.page_bytes)
    host.page(2).view(torch.bfloat16).fill_(7.0)
    ticket = engine.load_layerwise([2], [11])
    sums = []
    for layer in range(layout.num_layers):
        ticket.stream_wait(layer=layer)
        sums.append(dev.kv[layer, :, 11].float().sum())
    assert all(float(s) == 7.0 * layout.layer_bytes / 2 for s in sums)
    assert engine.stats()["path"] == "copy_engine"
