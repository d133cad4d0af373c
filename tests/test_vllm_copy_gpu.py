"""kvtier's vLLM connector, worker half, on a CUDA device: KV in vLLM's packed
``[blocks, heads, tokens, K|V]`` layout, tokens outer (NHD) and heads outer (HND) in memory
(GQA, 8 KV heads x 128, bf16 and fp16, 16- and 128-token blocks) is saved in the forward with
kvtier's row kernel, written to kvtier's pinned host tier, loaded back from there through
kvtier's device pool into fresh tensors at other block ids, and compared bit for bit; a prompt
saved from one layout loads into the other. Layers scaled down to 4 for test time. No vLLM
needed; skipped without CUDA (see conftest.py). Run with ``TRITON_INTERPRET=0`` (conftest
otherwise sets it for the CPU)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from kvtier.integrations.vllm.layout import block_layout
from kvtier.integrations.vllm.specs import LoadSpec, SaveSpec
from kvtier.integrations.vllm.worker import WorkerSide
from vllm_copy_support import (
    BACKENDS,
    Step,
    as_words,
    direct_round_trip,
    make_runtime,
    round_trip,
    slots,
    vllm_caches,
)

pytestmark = pytest.mark.gpu

LAYERS, HEADS, DIM = 4, 8, 128
#: vLLM blocks per tensor, and the prompt's blocks before and after (scattered, reordered).
NUM_BLOCKS = {16: 96, 128: 16}
OLD = {16: tuple(range(90, 10, -4)), 128: (11, 2, 7, 0, 14)}
NEW = {16: tuple(range(3, 83, 4)), 128: (5, 12, 1, 9, 3)}


def _run(kind_save, kind_load, dtype, block, tail, page=None, hooks=True, direct=False):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("set TRITON_INTERPRET=0 to run the kernels compiled on the GPU")
    old, new, n = OLD[block], NEW[block], NUM_BLOCKS[block]
    count = len(old) * block
    if page:                            # whole kvtier pages of several blocks
        count = count // page * page
        old, new = old[: count // block], new[: count // block]
    device = f"cuda:{torch.cuda.current_device()}"      # the runtime sets it on its thread
    runtime = make_runtime(LAYERS, HEADS, DIM, dtype, block, device, staging_pages=2 * len(old),
                           page=page, direct=direct)
    try:
        tokens = [(17 * i + 3) % 30000 + 5 for i in range(count)]
        if direct:     # the kernel reads and writes pinned host pages, no staging page
            worker, source, target = direct_round_trip(runtime, kind_save, kind_load, n, device,
                                                       tokens, old, new, count - tail,
                                                       use_kernels=None)
            assert worker.direct is not None and runtime.cache.host_pool.pinned
            assert runtime.cache.stats()["counters"].get("load_back_pages_total", 0) == 0
            tail = 0                    # the claim's last block moves whole
        else:
            worker, source, target = round_trip(runtime, kind_save, kind_load, n, device,
                                                tokens, old, new, count - tail,
                                                use_kernels=None, hooks=hooks)
        assert worker.blocks is not None, "the CUDA path must use the transfer kernels"
        assert runtime.counts["load_errors"] == 0
        was, now = slots(old, block, count - tail), slots(new, block, count - tail)
        for name in source:
            save = block_layout(BACKENDS[kind_save], source[name], HEADS, DIM)
            load = block_layout(BACKENDS[kind_load], target[name], HEADS, DIM)
            for got, want in zip(load.read(target[name], now.to(device)),
                                 save.read(source[name], was.to(device)), strict=True):
                assert torch.equal(as_words(got), as_words(want)), name
            mask = torch.ones(n * block, dtype=torch.bool)
            mask[now] = False
            for rest in load.read(target[name], mask.nonzero().squeeze(1).to(device)):
                assert int(as_words(rest).abs().sum()) == 0, f"{name}: a slot outside the load"
    finally:
        runtime.close(10.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [16, 128])
@pytest.mark.parametrize("kind", ["nhd", "hnd"])
def test_vllm_blocks_round_trip_through_the_host_tier_byte_exact(kind, block, dtype):
    _run(kind, kind, dtype, block, tail=1)


@pytest.mark.parametrize("kind", ["nhd", "hnd"])
def test_the_direct_path_moves_blocks_to_pinned_host_pages_and_back_byte_exact(kind):
    _run(kind, kind, torch.bfloat16, 16, tail=3, direct=True)


@pytest.mark.parametrize("block", [16, 128])
def test_whole_block_loads_are_byte_exact(block):
    _run("hnd", "hnd", torch.bfloat16, block, tail=0)


@pytest.mark.parametrize("save_kind,load_kind", [("nhd", "hnd"), ("hnd", "nhd")])
def test_pages_saved_from_one_backend_load_into_the_other(save_kind, load_kind):
    _run(save_kind, load_kind, torch.bfloat16, 16, tail=5)


def test_a_long_hit_copied_while_the_forward_reads_it_is_byte_exact():
    # 256 blocks of 32 layers (512 MiB): the host -> pool copy, left in flight layer by layer,
    # takes ~10 ms on the bus and starts, as the worker's pool -> block copies do, once the
    # device is done with the work before it (200 ms of it here). Each of the worker's copies
    # must wait for its own layer on the device, or it reads pages not yet landed. Twice, each
    # with a runtime of its own: in the first, compiling the kernels holds the host back long
    # enough for any copy to land.
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("set TRITON_INTERPRET=0 to run the kernels compiled on the GPU")
    for _ in range(2):
        _long_hit_round()


def _long_hit_round():
    layers, block, count_blocks, n = 32, 16, 256, 300
    g = torch.Generator().manual_seed(3)
    old = tuple(torch.randperm(n, generator=g)[:count_blocks].tolist())
    new = tuple(torch.randperm(n, generator=g)[:count_blocks].tolist())
    count = count_blocks * block
    device = f"cuda:{torch.cuda.current_device()}"
    runtime = make_runtime(layers, HEADS, DIM, torch.bfloat16, block, device,
                           staging_pages=count_blocks)
    try:
        tokens = [(13 * i + 5) % 30000 + 5 for i in range(count)]
        handles = []
        worker, source, target = round_trip(runtime, "nhd", "nhd", n, device, tokens,
                                            old, new, count, use_kernels=None,
                                            handles=handles, busy_ms=200.0)
        assert handles[0].start_tokens == 0 and handles[0].tokens == count
        assert handles[0].ticket is not None, "the scheduler half's copy was not left in flight"
        assert worker.blocks is not None
        was, now = slots(old, block, count).to(device), slots(new, block, count).to(device)
        for name in source:
            layout = block_layout("FLASH_ATTN", source[name], HEADS, DIM)
            for got, want in zip(layout.read(target[name], now), layout.read(source[name], was),
                                 strict=True):
                assert torch.equal(as_words(got), as_words(want)), name
    finally:
        runtime.close(10.0)


@pytest.mark.parametrize("kind", ["nhd", "hnd"])
def test_128_token_pages_move_whole_16_token_blocks_byte_exact(kind):
    _run(kind, kind, torch.bfloat16, 16, tail=3, page=128)


@pytest.mark.parametrize("kind", ["nhd", "hnd"])
def test_a_full_cuda_graph_step_copies_loads_before_and_saves_after_the_forward(kind):
    # vLLM calls no per-layer hook inside a full CUDA graph: the saves must still be copied
    # (after the forward) and the loads land whole before it.
    _run(kind, kind, torch.bfloat16, 16, tail=1, hooks=False)


def test_a_direct_load_does_not_queue_behind_the_saves_before_it():
    # A request waits for its load; saves before it (on a capped grid) may take far longer.
    # With the save stream held busy for about a second, the load must still land at once.
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("set TRITON_INTERPRET=0 to run the kernels compiled on the GPU")
    old, new, block = OLD[16], NEW[16], 16
    count = len(old) * block
    device = f"cuda:{torch.cuda.current_device()}"
    runtime = make_runtime(LAYERS, HEADS, DIM, torch.bfloat16, block, device,
                           staging_pages=2 * len(old), direct=True)
    try:
        tokens = [(11 * i + 7) % 30000 + 5 for i in range(count)]
        worker = WorkerSide(runtime, copy_in_step=True)
        caches = vllm_caches(runtime, "nhd", NUM_BLOCKS[16], device, seed=5)
        worker.register_kv_caches(caches, BACKENDS["nhd"])
        worker.wait_for_save(Step(saves=[SaveSpec("w", tuple(tokens), None, old)]))
        torch.cuda.synchronize()
        assert runtime.drain(60.0)
        with runtime.lock:
            runtime.staged["r"] = runtime.cache.hold_host(runtime.cache.match(tokens))
        assert worker.direct is not None and worker.direct.save_stream is not None
        with torch.cuda.stream(worker.direct.save_stream):
            torch.cuda._sleep(2_000_000_000)          # ~1 s of saves still running
        busy = torch.cuda.Event()
        busy.record(worker.direct.save_stream)
        worker.start_load_kv(Step(loads=[LoadSpec("r", 0, count, new)]))
        received: set[str] = set()
        for _ in range(400):
            received |= worker.take_received() or set()
            if "r" in received:
                break
            time.sleep(0.001)
        assert received == {"r"}, "the load waited for the save stream"
        assert not busy.query()
        torch.cuda.synchronize()
        was, now = slots(old, block, count).to(device), slots(new, block, count).to(device)
        for name, kv in caches.items():
            layout = block_layout("FLASH_ATTN", kv, HEADS, DIM)
            for got, want in zip(layout.read(kv, now), layout.read(kv, was), strict=True):
                assert torch.equal(as_words(got), as_words(want)), name
    finally:
        runtime.close(10.0)
