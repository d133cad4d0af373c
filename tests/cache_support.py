"""Helpers for the TieredCache and controller tests: a tiny layout, KV patterns, an engine cycle.

Every page's KV is a pattern computed from the page's tokens, so any page read back from any
tier can be checked byte for byte against what it must hold.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from kvtier.cache import TieredCache
from kvtier.config import build_config
from kvtier.keys import KeyNamespace, page_keys
from kvtier.layout import KVLayout
from kvtier.store.base import PageStore

P = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", page_size=P)
NAMESPACE = KeyNamespace("test-model", "fp0", "float32", LAYOUT.fingerprint(), P)


def make_cache(*, device_pages: int = 32, host_pages: int = 64,
               stores: dict[str, PageStore] | None = None, collective: Any = None,
               **controller: Any) -> TieredCache:
    flags: dict[str, Any] = {"cache.page_size": P, "cache.device_pages": device_pages,
                             "host.pool_bytes": host_pages * LAYOUT.page_bytes,
                             "controller.min_prefetch_tokens": 0,
                             "controller.io_workers": 2}
    flags.update({f"controller.{k}": v for k, v in controller.items()})
    config = build_config(env={}, flags=flags)
    return TieredCache.build(config, LAYOUT, NAMESPACE, stores=stores or {},
                             collective=collective)


def prompt(pages: int, seed: int, extra: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 5000) for _ in range(pages * P + extra)]


def pattern(page_tokens: list[int]) -> torch.Tensor:
    """KV of one page, [layers, parts, page_size, heads, dim], a function of its tokens."""
    base = torch.tensor(page_tokens, dtype=torch.float32).view(P, 1, 1)
    out = torch.empty(LAYOUT.num_layers, LAYOUT.parts, P, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    for layer in range(LAYOUT.num_layers):
        for part in range(LAYOUT.parts):
            scale = 1 + layer * LAYOUT.parts + part
            offsets = torch.arange(LAYOUT.num_kv_heads * LAYOUT.head_dim).view(
                1, LAYOUT.num_kv_heads, LAYOUT.head_dim) / 8
            out[layer, part] = base * scale + offsets
    return out


def write_kv(cache: TieredCache, tokens: list[int], page_ids: list[int], first_page: int = 0) -> None:
    kv = cache.device_pool.kv
    for i, page_id in enumerate(page_ids):
        page = first_page + i
        kv[:, :, page_id] = pattern(tokens[page * P:(page + 1) * P])


def assert_kv(cache: TieredCache, tokens: list[int], page_ids: list[int],
              first_page: int = 0) -> None:
    kv = cache.device_pool.kv
    for i, page_id in enumerate(page_ids):
        page = first_page + i
        want = pattern(tokens[page * P:(page + 1) * P])
        if not torch.equal(kv[:, :, page_id], want):
            raise AssertionError(f"device page {page_id} does not hold prompt page {page}")


def serve(cache: TieredCache, tokens: list[int], salt: Any = None, *,
          recompute_tokens: int = 0, check: bool = True) -> tuple[Any, Any]:
    """One engine cycle: match, load (checking the bytes), compute the rest, commit, release."""
    hit = cache.match(tokens, salt)
    loaded = cache.load(hit, recompute_tokens=recompute_tokens)
    try:
        start = loaded.start_tokens // P
        if check:
            assert_kv(cache, tokens, loaded.device_page_ids, start)
        full = len(tokens) // P
        held = dict(zip(range(start, loaded.tokens // P), loaded.device_page_ids, strict=True))
        missing = [p for p in range(full) if p not in held]
        fresh = cache.allocate(len(missing))
        for page, page_id in zip(missing, fresh, strict=True):
            held[page] = page_id
            write_kv(cache, tokens, [page_id], page)
        cache.commit(tokens, [held[p] for p in range(full)], salt, loaded=loaded)
    finally:
        cache.release(loaded)
    return hit, loaded


def store_keys(tokens: list[int], salt: Any = None) -> list[bytes]:
    return [bytes(k) for k in page_keys(tokens, P, NAMESPACE, salt)]
