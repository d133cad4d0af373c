"""vLLM KV tensor layouts <-> kvtier's canonical token rows, on tensors vLLM itself allocates.

The packed backends' tensors come from vLLM's own ``allocate_kv_cache`` over every
``KVCacheLayout`` it offers (``VLLM_KV_CACHE_LAYOUT``: tokens or heads outer, layer- or
block-compact, cross-layer), with strides from its own ``compute_layout_strides``; rows are
written through the views vLLM's attention kernels read (``kv_cache.transpose(1, 2).split(
head_size, -1)``) and must read back through kvtier's layout, by slot, by block and with the
row kernel. The CPU backend's layout is checked against vLLM's own cache-write op. Rows read
from any layout are the same canonical rows, so a page stored from one loads into another.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.integrations.vllm import compat
from kvtier.integrations.vllm.blocks import BlockCopier
from kvtier.integrations.vllm.layout import BlockLayout, block_layout, check_cpu_layout

BLOCKS, BLOCK, HEADS, DIM = 6, 16, 2, 32
SHAPES = {"CPU_ATTN": (BLOCKS, HEADS, BLOCK, 2 * DIM)}


def _vllm_caches(layout_name: str, layers: int = 3, dtype=torch.float32):
    """Per-layer tensors as vLLM 0.32 allocates them for a full-attention group in
    ``layout_name``, and the spec they were made for."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        compute_layout_strides,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    layout = KVCacheLayout[layout_name]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=dtype)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    block_bytes = spec.page_size_bytes * layers if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, BLOCKS, layers, layout, fixed_strides=(None, block_bytes, None, None, None))
    size = spec.page_size_bytes * BLOCKS * layers
    tensor = KVCacheTensor(size=size, layers=names, layer_stride=layer_stride,
                           block_stride=block_stride)
    config = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[tensor],
                           kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    return allocate_kv_cache(config, torch.device("cpu"), layout), spec


def _vllm_kv(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[blocks, tokens, heads, dim]`` as vLLM's FLASH_ATTN/FLASHINFER/TRITON_ATTN
    read them."""
    return kv.transpose(1, 2).split(DIM, dim=-1)


VLLM_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


@pytest.mark.parametrize("layout_name", VLLM_LAYOUTS)
@pytest.mark.parametrize("backend", ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"])
def test_rows_vllm_writes_read_back_in_every_vllm_layout(layout_name, backend):
    caches, spec = _vllm_caches(layout_name)
    g = torch.Generator().manual_seed(11)
    slots = torch.tensor([3, 17, 40, 95, 0, 51])
    for name, kv in caches.items():
        assert tuple(kv.shape) == compat.expected_kv_shape(object(), spec, BLOCKS, "auto")
        layout = block_layout(backend, kv, HEADS, DIM, BLOCK)
        key_cache, value_cache = _vllm_kv(kv)
        key_cache.copy_(torch.randn(key_cache.shape, generator=g))
        value_cache.copy_(torch.randn(value_cache.shape, generator=g))
        got_k, got_v = layout.read(kv, slots)
        blocks, offsets = slots // BLOCK, slots % BLOCK
        assert torch.equal(got_k, key_cache[blocks, offsets]), name
        assert torch.equal(got_v, value_cache[blocks, offsets]), name
        whole_k, whole_v = layout.read_blocks(kv, torch.tensor([5, 2]))
        assert torch.equal(whole_k, key_cache[[5, 2]]) and torch.equal(whole_v, value_cache[[5, 2]])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the row kernel runs on the CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("layout_name", VLLM_LAYOUTS)
def test_whole_blocks_move_by_rows_in_every_vllm_layout(layout_name):
    caches, _ = _vllm_caches(layout_name, dtype=torch.bfloat16)
    targets, _ = _vllm_caches(layout_name, dtype=torch.bfloat16)
    pool = torch.zeros(3, 2, 4, BLOCK, HEADS, DIM, dtype=torch.bfloat16)
    first = next(iter(caches.values()))
    copier = BlockCopier.for_device_pool(block_layout("FLASH_ATTN", first, HEADS, DIM), pool)
    g = torch.Generator().manual_seed(12)
    for layer, (kv, target) in enumerate(zip(caches.values(), targets.values(), strict=True)):
        kv.copy_(torch.randn(kv.shape, generator=g))
        copier.save(layer, np.array([4, 1]), np.array([0, 3]), kv)
        copier.load(layer, np.array([0, 3]), np.array([2, 5]), target)
        key_cache, value_cache = _vllm_kv(kv)
        got_k, got_v = _vllm_kv(target)
        assert torch.equal(pool[layer, 0, 0], key_cache[4])          # canonical page layers
        assert torch.equal(pool[layer, 1, 3], value_cache[1])
        assert torch.equal(got_k[[2, 5]], key_cache[[4, 1]])
        assert torch.equal(got_v[[2, 5]], value_cache[[4, 1]])
        assert int(got_k[[0, 1, 3, 4]].abs().sum() + got_v[[0, 1, 3, 4]].abs().sum()) == 0


def test_layouts_of_other_shapes_or_tensors_laid_out_apart_are_refused():
    caches, _ = _vllm_caches("LBNHC")
    with pytest.raises(ConfigError, match="block"):            # not the spec's block size
        block_layout("FLASH_ATTN", next(iter(caches.values())), HEADS, DIM, block_size=32)
    with pytest.raises(ConfigError, match="attention backend"):
        block_layout("FLASH_ATTN", torch.zeros(2, BLOCKS, BLOCK, HEADS, DIM), HEADS, DIM)


def test_supported_vllm_versions_and_hidden_layer_steps():
    assert compat.check_version((0, 26, 0)) == (0, 26, 0)
    assert compat.check_version(compat.parse_version("0.33.9+cu130")) == (0, 33, 9)
    for outside in ((0, 25, 2), (0, 34, 0), (1, 0, 0)):
        with pytest.raises(ConfigError, match="vLLM version"):
            compat.check_version(outside)
    assert compat.offloading_plugins_refusal((0, 32, 0)) == ""
    assert "0.32" in compat.offloading_plugins_refusal((0, 26, 0))
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import ForwardContext

    def context(mode):
        return ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={},
                              cudagraph_runtime_mode=mode)
    assert compat.graph_hides_layers(context(CUDAGraphMode.FULL))
    assert not compat.graph_hides_layers(context(CUDAGraphMode.PIECEWISE))
    assert not compat.graph_hides_layers(context(CUDAGraphMode.NONE))
    assert not compat.graph_hides_layers(None)


def _rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HEADS, DIM, generator=g), torch.randn(n, HEADS, DIM, generator=g)


def _vllm_cpu_write(keys, values, key_cache, value_cache, slots):
    from vllm import _custom_ops as ops

    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, "vec16",
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")


@pytest.mark.parametrize("backend", sorted(SHAPES))
def test_rows_written_at_slots_read_back_exactly(backend):
    kv = torch.zeros(SHAPES[backend])
    layout = block_layout(backend, kv, HEADS, DIM)
    slots = torch.tensor([3, 17, 40, 95, 0])
    keys, values = _rows(len(slots), seed=1)
    layout.write(kv, slots, keys, values)
    got_k, got_v = layout.read(kv, slots)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    assert int((kv != 0).sum()) == 2 * len(slots) * HEADS * DIM     # nothing else was touched


def test_cpu_layout_matches_vllms_own_cache_write():
    kv = torch.zeros(SHAPES["CPU_ATTN"])
    layout = block_layout("CPU_ATTN", kv, HEADS, DIM)
    check_cpu_layout(layout, torch.float32, _vllm_cpu_write)      # raises if it differs
    key_cache, value_cache = kv.view(BLOCKS, HEADS, 2 * BLOCK, DIM).chunk(2, dim=2)
    slots = torch.tensor([5, 33, 70])
    keys, values = _rows(3, seed=2)
    _vllm_cpu_write(keys, values, key_cache, value_cache, slots)
    got_k, got_v = layout.read(kv, slots)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)


def test_a_cpu_kernel_packing_blocks_otherwise_is_refused():
    def untransposed_write(keys, values, key_cache, value_cache, slots):
        flat = key_cache.reshape(-1)
        flat[: keys.numel()] = keys.permute(1, 0, 2).reshape(-1)

    layout = BlockLayout("cpu", BLOCKS, BLOCK, HEADS, DIM)
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        check_cpu_layout(layout, torch.float32, untransposed_write)


def test_an_unknown_backend_or_shape_is_refused():
    with pytest.raises(ConfigError, match="attention backend"):
        block_layout("FLEX_ATTENTION", torch.zeros(SHAPES["CPU_ATTN"]), HEADS, DIM)
    with pytest.raises(ConfigError, match="attention backend"):      # CPU blocks are contiguous
        block_layout("CPU_ATTN", torch.zeros(BLOCKS, BLOCK, HEADS, 2 * DIM).transpose(1, 2),
                     HEADS, DIM)


@pytest.mark.parametrize("backend", sorted(SHAPES))
def test_whole_blocks_read_as_the_rows_of_their_slots(backend):
    kv = torch.randn(SHAPES[backend], generator=torch.Generator().manual_seed(5))
    layout = block_layout(backend, kv, HEADS, DIM)
    blocks = torch.tensor([4, 1, 5])
    slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK)).flatten()
    keys, values = layout.read_blocks(kv, blocks)
    want_keys, want_values = layout.read(kv, slots)
    assert keys.shape == (3, BLOCK, HEADS, DIM)
    assert torch.equal(keys.flatten(0, 1), want_keys)
    assert torch.equal(values.flatten(0, 1), want_values)
