"""kvtier's vLLM connector, worker half, on the CPU: prompts saved from vLLM-shaped KV tensors
load back byte for byte into other blocks, with kvtier's transfer kernels (under
TRITON_INTERPRET=1) and with the torch gathers; pages are canonical, so a prompt saved from
flash-attention's layout loads into FlashInfer's. No vLLM needed (tiny shapes; the GPU
version is ``test_vllm_copy_gpu``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvtier.integrations.vllm.blocks import BlockCopier
from kvtier.integrations.vllm.layout import block_layout
from vllm_copy_support import (
    BACKENDS,
    BLOCK,
    DIM,
    HEADS,
    LAYERS,
    NEW,
    NUM_BLOCKS,
    OLD,
    HeldCopy,
    Step,
    as_words,
    check_moved,
    interpreted,
    make_runtime,
    packed_kv,
    round_trip,
    slots,
)


def _prompt(n: int) -> list[int]:
    return [(31 * i + 7) % 1000 + 5 for i in range(n)]


def _check(save_kind, load_kind, source, target, count, block=BLOCK):
    check_moved(save_kind, load_kind, source, target, slots(OLD, block, count),
                slots(NEW, block, count), HEADS, DIM)


@pytest.fixture
def runtime(request):
    dtype = getattr(request, "param", torch.bfloat16)
    rt = make_runtime(LAYERS, HEADS, DIM, dtype, BLOCK, "cpu", staging_pages=16)
    yield rt
    rt.close(5.0)


@interpreted
@pytest.mark.parametrize("runtime", [torch.bfloat16, torch.float16], indirect=True)
@pytest.mark.parametrize("kind", ["nhd", "hnd"])
def test_kernels_save_and_load_vllm_blocks_byte_exact(runtime, kind):
    count = len(OLD) * BLOCK
    worker, source, target = round_trip(runtime, kind, kind, NUM_BLOCKS, "cpu", _prompt(count),
                                        OLD, NEW, count - 3, use_kernels=True)
    assert worker.blocks is not None
    _check(kind, kind, source, target, count - 3)
    assert runtime.counts["load_errors"] == 0


@interpreted
@pytest.mark.parametrize("kind", ["nhd", "hnd"])
def test_a_save_in_the_step_copies_every_layer_in_one_launch(runtime, kind, monkeypatch):
    """The CUDA flow (saves inside ``wait_for_save``) on CPU tensors: the save is one launch
    of the block kernel over both layers, the load one per layer, and every byte comes back."""
    from kvtier.transfer import rows

    launched: list[int] = []
    launch = rows.BoundRowCopy.launch
    monkeypatch.setattr(rows.BoundRowCopy, "launch", lambda self, plan, ids=None: (
        launched.append(self.num_layers), launch(self, plan, ids))[1])
    count = len(OLD) * BLOCK
    worker, source, target = round_trip(runtime, kind, kind, NUM_BLOCKS, "cpu", _prompt(count),
                                        OLD, NEW, count - 3, use_kernels=True,
                                        copy_in_step=True)
    _check(kind, kind, source, target, count - 3)
    warm_up = [1, 1]                      # each registration: one block saved and loaded
    assert launched == warm_up + [LAYERS] + warm_up + [1] * LAYERS
    assert runtime.counts["saved_tokens"] == count and runtime.counts["load_errors"] == 0


@pytest.mark.parametrize("use_kernels", [pytest.param(True, marks=interpreted), False])
@pytest.mark.parametrize("kind", ["nhd", "hnd"])
def test_pages_of_two_blocks_save_and_load_whole_blocks_byte_exact(kind, use_kernels):
    # kvtier pages twice vLLM's block: each block moves whole, as one sub-page of a page
    # (``vllm.blocks.block_view``), and lands where the tokens were.
    rt = make_runtime(LAYERS, HEADS, DIM, torch.bfloat16, BLOCK, "cpu", staging_pages=8,
                      page=2 * BLOCK)
    try:
        count = 4 * BLOCK
        worker, source, target = round_trip(rt, kind, kind, NUM_BLOCKS, "cpu", _prompt(count),
                                            OLD[:4], NEW[:4], count - 3,
                                            use_kernels=use_kernels)
        assert (worker.blocks is not None) == use_kernels
        _check(kind, kind, source, target, count - 3)
        assert rt.counts["load_errors"] == 0
    finally:
        rt.close(5.0)


@interpreted
@pytest.mark.parametrize("save_kind,load_kind", [("nhd", "hnd"), ("hnd", "nhd")])
def test_a_prompt_saved_from_one_backend_loads_into_the_other(runtime, save_kind, load_kind):
    count = len(OLD) * BLOCK
    _, source, target = round_trip(runtime, save_kind, load_kind, NUM_BLOCKS, "cpu",
                                   _prompt(count), OLD, NEW, count - 1, use_kernels=True)
    _check(save_kind, load_kind, source, target, count - 1)


@pytest.mark.parametrize("use_kernels", [pytest.param(True, marks=interpreted), False])
def test_a_load_in_flight_is_waited_for_layer_by_layer_and_released_once_landed(runtime,
                                                                                 use_kernels):
    # The scheduler half leaves a hit's host -> pool copy in flight (on CUDA): the forward's
    # stream must wait for each layer before the worker copies it out of the pool, and the
    # step's end must not release (and so wait on the host for) a copy that has not landed.
    count = len(OLD) * BLOCK
    copy, handles = HeldCopy(), []
    worker, source, target = round_trip(runtime, "nhd", "nhd", NUM_BLOCKS, "cpu",
                                        _prompt(count), OLD, NEW, count - 3,
                                        use_kernels=use_kernels, in_flight=copy,
                                        handles=handles)
    assert copy.waited == list(range(LAYERS))
    _check("nhd", "nhd", source, target, count - 3)
    (loaded,) = handles
    assert not loaded.released and not copy.landed
    worker.start_load_kv(Step())                # a later step: still in flight, still held
    assert not loaded.released
    copy.landed = True
    worker.start_load_kv(Step())
    assert loaded.released


def test_a_step_waits_for_copies_of_loads_staged_for_later_steps(runtime):
    # Pages a staged load is still copying are in kvtier's device tier already: a request
    # served from them may run first, so its step must wait for that copy.
    count = len(OLD) * BLOCK
    worker, _, _ = round_trip(runtime, "nhd", "nhd", NUM_BLOCKS, "cpu", _prompt(count),
                              OLD, NEW, count - 3, use_kernels=False)
    pending, landed = HeldCopy(), HeldCopy()
    landed.landed = True
    runtime.staged.update(later=SimpleNamespace(ticket=pending),
                          done=SimpleNamespace(ticket=landed), no_copy=SimpleNamespace(ticket=None))
    try:
        worker.start_load_kv(Step())
    finally:
        for key in ("later", "done", "no_copy"):
            runtime.staged.pop(key)
    assert pending.waited == [None] and landed.waited == []


@pytest.mark.parametrize("kind", ["nhd", "hnd", "cpu"])
def test_torch_gathers_save_and_load_vllm_blocks_byte_exact(runtime, kind):
    count = len(OLD) * BLOCK
    worker, source, target = round_trip(runtime, kind, kind, NUM_BLOCKS, "cpu", _prompt(count),
                                        OLD, NEW, count - 5, use_kernels=False)
    assert worker.blocks is None
    _check(kind, kind, source, target, count - 5)


@interpreted
@pytest.mark.parametrize("kind", ["nhd", "hnd"])
def test_block_copier_writes_canonical_page_layers(kind):
    """A block copied into a pool page is that page's layer in kvtier's order (K part, V part)."""
    layers, pages = 3, 6
    pool = torch.zeros(layers, 2, pages, BLOCK, HEADS, DIM, dtype=torch.float16)
    kv = packed_kv(kind, NUM_BLOCKS, BLOCK, HEADS, DIM, torch.float16)
    kv.copy_(torch.randn(kv.shape).half())
    layout = block_layout(BACKENDS[kind], kv, HEADS, DIM)
    copier = BlockCopier.for_device_pool(layout, pool)
    copier.save(1, [4, 0, 9], [2, 5, 0], kv)
    keys, values = layout.read_blocks(kv, torch.tensor([4, 0, 9]))
    assert torch.equal(pool[1, 0, [2, 5, 0]], keys) and torch.equal(pool[1, 1, [2, 5, 0]], values)
    assert int(pool[[0, 2]].abs().sum()) == 0 and int(pool[1, :, [1, 3, 4]].abs().sum()) == 0
    back = packed_kv(kind, NUM_BLOCKS, BLOCK, HEADS, DIM, torch.float16)
    copier.load(1, [2, 5, 0], [1, 11, 6], back)
    got_k, got_v = layout.read_blocks(back, torch.tensor([1, 11, 6]))
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    untouched = torch.tensor(sorted(set(range(NUM_BLOCKS)) - {1, 11, 6}))
    assert int(back.index_select(0, untouched).abs().sum()) == 0


def test_block_copies_are_checked_before_anything_moves():
    pool = torch.zeros(LAYERS, 2, 4, BLOCK, HEADS, DIM, dtype=torch.bfloat16)
    kv = packed_kv("nhd", NUM_BLOCKS, BLOCK, HEADS, DIM, torch.bfloat16)
    copier = BlockCopier.for_device_pool(block_layout("FLASH_ATTN", kv, HEADS, DIM), pool)
    with pytest.raises(ValueError, match="out of range"):
        copier.plan("load", [4], [0])                     # the pool has sub-pages 0..3
    with pytest.raises(ValueError, match="out of range"):
        copier.plan("store", [NUM_BLOCKS], [0])
    with pytest.raises(ValueError, match="twice"):
        copier.plan("load", [0, 1], [3, 3])
    cpu = block_layout("CPU_ATTN", torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * DIM), HEADS, DIM)
    with pytest.raises(ValueError, match="rows"):
        BlockCopier.for_device_pool(cpu, pool)


@interpreted
def test_registering_warms_the_block_kernels_up_and_leaves_every_byte_as_it_was(runtime):
    from kvtier.integrations.vllm.worker import WorkerSide
    from vllm_copy_support import vllm_caches

    caches = vllm_caches(runtime, "nhd", NUM_BLOCKS, "cpu", seed=3)
    before = {name: kv.clone() for name, kv in caches.items()}
    free = runtime.cache.device_pool.allocator.num_free
    launched: list[str] = []
    save, load = BlockCopier.save, BlockCopier.load
    worker = WorkerSide(runtime, use_kernels=True)
    try:
        BlockCopier.save = lambda self, *a: (launched.append("save"), save(self, *a))[1]
        BlockCopier.load = lambda self, *a: (launched.append("load"), load(self, *a))[1]
        worker.register_kv_caches(caches, BACKENDS["nhd"])
    finally:
        BlockCopier.save, BlockCopier.load = save, load
    assert launched == ["save", "load"]                    # both ways, before any request
    assert all(torch.equal(as_words(caches[n]), as_words(before[n])) for n in caches)
    assert runtime.cache.device_pool.allocator.num_free == free   # its page went back
    assert not runtime.cache.controller.engine_pages
