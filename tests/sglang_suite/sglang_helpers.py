"""Builders for SGLang objects the plug-in suite drives: host pools over CPU tensors, configs.

SGLang's host pools mirror a device pool; here the "device" buffers are CPU tensors, which is
all the storage path needs (it only touches the host pool's ``kv_buffer``). Imported by the
suite's conftest and tests inside ``.venv-sglang``.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

CPU = torch.device("cpu")


def make_pool(kind: str = "mha", layout: str = "page_first", *, layers: int = 2, heads: int = 2,
              head_dim: int = 16, page_size: int = 4, pages: int = 32,
              dtype: torch.dtype = torch.bfloat16) -> Any:
    """A real SGLang MHA or MLA host pool of about ``pages`` pages (plus SGLang's padding page)."""
    tokens = pages * page_size
    if kind == "mla":
        rows = tuple(torch.zeros(tokens, 1, head_dim, dtype=dtype) for _ in range(layers))
        info = MLABufferInfo(buffers=rows, data_ptrs=_ptrs(rows), layer_indices=tuple(range(layers)),
                             device_layer_num=layers, page_size=page_size,
                             kv_lora_rank=head_dim - 4, qk_rope_head_dim=4, kv_cache_dim=head_dim,
                             dtype=dtype, device=CPU)
        return MLATokenToKVPoolHost(info, 1.0, 0, page_size, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=tokens, start_layer=0, end_layer=layers,
                                    target_layer_num=layers)
    k = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    buffers = KVBuffers(k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v),
                        layout=KVBufferLayout.NHD)
    info = MHABufferInfo(buffers=buffers, page_size=page_size, head_num=heads, head_dim=head_dim,
                         v_head_dim=head_dim, dtype=dtype, device=CPU)
    return MHATokenToKVPoolHost(info, 1.0, 0, page_size, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=tokens, start_layer=0, end_layer=layers)


def _ptrs(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def make_config(*, tp_rank: int = 0, tp_size: int = 1, mla: bool = False, extra: dict | None = None,
                model: str = "test/model", pp_rank: int = 0, pp_size: int = 1) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
                                attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
                                enable_storage_metrics=False, is_page_first_layout=True,
                                model_name=model, extra_config=extra)


def fill_random(pool: Any, seed: int) -> None:
    """Give every byte of the pool's KV a seeded random value."""
    gen = torch.Generator().manual_seed(seed)
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))


def page_slots(pool: Any, pages: list[int]) -> torch.Tensor:
    """Host slot indices of whole pages, as SGLang passes them (page_size slots per page)."""
    ps = pool.page_size
    return torch.cat([torch.arange(p * ps, (p + 1) * ps, dtype=torch.int64) for p in pages])


def page_bytes(pool: Any, page: int) -> bytes:
    """A page's bytes in the pool's own flat order (what SGLang's get_data_page returns)."""
    flat = pool.get_data_page(page * pool.page_size, flat=True)
    return flat.contiguous().view(torch.uint8).numpy().tobytes()


def names(count: int, tag: str = "p") -> list[str]:
    """SGLang-style page names (hex digests) for a chain of ``count`` pages."""
    import hashlib

    return [hashlib.sha256(f"{tag}{i}".encode()).hexdigest() for i in range(count)]
