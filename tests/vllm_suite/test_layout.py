"""vLLM KV tensor layouts <-> kvtier's canonical token rows (CPU tensors; GPU layouts included).

The CPU backend's layout is checked against vLLM's own cache-write op; flash-attention's and
FlashInfer's against where their kernels put a token (``[2, blocks, block, heads, dim]`` and
``[blocks, 2, block, heads, dim]``). Rows read from any layout are the same canonical rows, so a
page stored from one backend loads into another.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.integrations.vllm_layout import BlockLayout, block_layout, check_cpu_layout

BLOCKS, BLOCK, HEADS, DIM = 6, 16, 2, 32
SHAPES = {"CPU_ATTN": (BLOCKS, HEADS, BLOCK, 2 * DIM), "FLASH_ATTN": (2, BLOCKS, BLOCK, HEADS, DIM),
          "FLASHINFER": (BLOCKS, 2, BLOCK, HEADS, DIM)}


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


def test_flash_and_flashinfer_rows_sit_where_their_kernels_read_them():
    keys, values = _rows(1, seed=3)
    slot = torch.tensor([2 * BLOCK + 5])
    flash = torch.zeros(SHAPES["FLASH_ATTN"])
    block_layout("FLASH_ATTN", flash, HEADS, DIM).write(flash, slot, keys, values)
    assert torch.equal(flash[0, 2, 5], keys[0]) and torch.equal(flash[1, 2, 5], values[0])
    infer = torch.zeros(SHAPES["FLASHINFER"])
    block_layout("FLASHINFER", infer, HEADS, DIM).write(infer, slot, keys, values)
    assert torch.equal(infer[2, 0, 5], keys[0]) and torch.equal(infer[2, 1, 5], values[0])


def test_rows_moved_between_backends_keep_their_values():
    slots = torch.arange(BLOCK, 3 * BLOCK)
    keys, values = _rows(len(slots), seed=4)
    tensors = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    cpu = block_layout("CPU_ATTN", tensors["CPU_ATTN"], HEADS, DIM)
    cpu.write(tensors["CPU_ATTN"], slots, keys, values)
    canonical = cpu.read(tensors["CPU_ATTN"], slots)              # what a stored page holds
    for name in ("FLASH_ATTN", "FLASHINFER"):
        layout = block_layout(name, tensors[name], HEADS, DIM)
        layout.write(tensors[name], slots.flip(0), *canonical)   # other blocks, other order
        got = layout.read(tensors[name], slots.flip(0))
        assert torch.equal(got[0], keys) and torch.equal(got[1], values)


def test_an_unknown_backend_or_shape_is_refused():
    with pytest.raises(ConfigError, match="attention backend"):
        block_layout("FLEX_ATTENTION", torch.zeros(SHAPES["FLASH_ATTN"]), HEADS, DIM)
    with pytest.raises(ConfigError, match="attention backend"):
        block_layout("CPU_ATTN", torch.zeros(SHAPES["FLASH_ATTN"]), HEADS, DIM)


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
