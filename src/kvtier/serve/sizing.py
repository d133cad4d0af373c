"""Pool sizes of ``kvtier serve`` that the user left unset, derived from the model.

Owns ``size_pools(config, lm, explicit)`` and ``model_len(config, lm)`` (the model's positions,
or fewer with ``server.max_model_len``). The longest sequence the server accepts (that length,
at most ``server.max_prompt_tokens`` + ``engine.max_new_tokens``) times the
model's KV bytes per token is one full context. Unless set by a file, a ``KVTIER_*`` variable
or a flag:

- on the CPU, ``cache.device_pages`` holds ``engine.max_running`` full contexts (every running
  sequence at full length), at most ``CPU_DEVICE_POOL_CAP_BYTES``;
- ``host.pool_bytes`` holds twice the device tier's contexts (the host tier keeps what the
  device tier evicts), at most the configured default (2 GiB), and on the CPU at most
  ``CPU_HOST_POOL_CAP_BYTES``.

On CUDA the device pool keeps its share of free device memory. Main thread, once at start.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvtier.config import KvtierConfig

#: A CPU prefills a few thousand tokens a second at best: 64 MiB of KV (32k tokens of the tiny
#: models' 2 KiB per token) is many seconds of compute saved, and a demo server stays small.
CPU_DEVICE_POOL_CAP_BYTES = 64 << 20
#: Twice the CPU device cap, as the host tier holds twice the device tier's contexts.
CPU_HOST_POOL_CAP_BYTES = 2 * CPU_DEVICE_POOL_CAP_BYTES
HOST_CONTEXTS_PER_DEVICE_CONTEXT = 2


def model_len(config: KvtierConfig, lm: Any) -> int:
    """Positions a request may use, prompt plus generated tokens: the model's, or
    ``server.max_model_len`` when set lower."""
    positions = int(lm.max_positions)
    return min(positions, config.server.max_model_len) if config.server.max_model_len \
        else positions


def context_tokens(config: KvtierConfig, lm: Any) -> int:
    """The longest sequence this server accepts: prompt plus generated tokens."""
    return min(model_len(config, lm),
               config.server.max_prompt_tokens + config.engine.max_new_tokens)


def size_pools(config: KvtierConfig, lm: Any, explicit: set[str]) -> KvtierConfig:
    """``config`` with the pool sizes above filled in where ``explicit`` lacks them."""
    layout = lm.kv_layout(config.cache.page_size)
    on_cpu = str(lm.device).startswith("cpu")
    contexts = config.engine.max_running
    full_bytes = context_tokens(config, lm) * layout.bytes_per_token
    cache, host = config.cache, config.host
    if on_cpu and "cache.device_pages" not in explicit and cache.device_pages == 0:
        device_bytes = min(contexts * full_bytes, CPU_DEVICE_POOL_CAP_BYTES)
        cache = replace(cache, device_pages=max(1, device_bytes // layout.page_bytes))
    if "host.pool_bytes" not in explicit and host.pool_bytes > 0:
        cap = min(host.pool_bytes, CPU_HOST_POOL_CAP_BYTES if on_cpu else host.pool_bytes)
        wanted = HOST_CONTEXTS_PER_DEVICE_CONTEXT * contexts * full_bytes
        pages = max(1, min(wanted, cap) // layout.page_bytes)
        host = replace(host, pool_bytes=pages * layout.page_bytes)
    return replace(config, cache=cache, host=host)
