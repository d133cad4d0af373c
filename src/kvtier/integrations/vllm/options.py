"""Options of kvtier's vLLM connector, read from ``kv_connector_extra_config``.

Owns ``VllmConnectorOptions`` (frozen) and ``parse_connector_config``. vLLM hands the connector
one flat JSON object; every key is checked, so a typo is refused at start naming the key, the
value and what is allowed::

    {"disk_url": "file:///nvme/kvtier", "remote_url": "redis://10.0.0.5:6379/0",
     "page_size": 64, "host_pool_bytes": "4GiB", "staging_pages": 512,
     "save_queue_depth": 8, "background_priority": "idle", "direct": false}

Store keys are the fields of kvtier's ``store`` config section (same names, checks and defaults);
``config`` names a kvtier YAML file read first, and ``KVTIER_*`` environment variables apply as
everywhere else. ``model_fingerprint`` names the weights in every page key: left out, it is
derived from the checkpoint vLLM loads (``kvtier.integrations.vllm.fingerprint``: config.json
plus each weight file's name, size, header and sampled blocks, a few MiB read at start even for
a 70B checkpoint), so a fine-tune written over its base never reads the base's pages; set it to
make two checkpoints share pages on purpose, or where kvtier cannot read the weights. Pure
Python, no torch or vLLM imports; runs on the thread that builds the connector.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvtier.config import KvtierConfig, StoreConfig, build_config
from kvtier.config_flags import explicit_paths
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.saver import check_priority

STORE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(StoreConfig))

#: Connector keys that set a kvtier config field directly.
CONFIG_KEYS: dict[str, str] = {
    "page_size": "cache.page_size",
    "staging_pages": "cache.device_pages",
    "eviction_policy": "cache.eviction_policy",
    "host_pool_bytes": "host.pool_bytes",
    "pinned_budget_bytes": "host.pinned_budget_bytes",
    "write_policy": "controller.write_policy",
    "prefetch_policy": "controller.prefetch_policy",
    "prefetch_timeout_max_s": "controller.prefetch_timeout_max_s",
    "io_workers": "controller.io_workers",
    "copy_path": "host.copy_path",
    "load_programs": "host.load_programs",
    "store_programs": "host.store_programs",
}

#: Staging pages (kvtier's own page pool between vLLM's blocks and the host tier) when unset:
#: the floor, and the size on the CPU backend; on CUDA the runtime sizes the pool to hold two
#: prompts of ``max_model_len`` (one loading, one being saved), at most half the GPU memory
#: free when the connector starts (after vLLM has taken its share).
DEFAULT_STAGING_PAGES = 256

#: kvtier device pages on the direct path (``"direct": true``), where nothing is staged: the
#: pool's least size (``TieredCache`` keeps a device tier; the connector never fills it).
DIRECT_DEVICE_PAGES = 1

#: Grid cap of the GPU -> host copies of saved prompts when unset (``host.store_programs``).
#: Saves cross the bus while vLLM's next prefills run; every program they hold is an SM those
#: prefills lack, and a prefill produces KV at a few GB/s, well under what 4 programs store.
#: On an H100 (vLLM 0.26, 8B shape, CUDA graphs) 4 programs against kvtier's default 16 moved
#: serving throughput with no hits from 0.964x to 0.979x of vLLM alone and the miss TTFT from
#: 1.06x/1.02x to 1.04x/1.006x at 4k/32k tokens (benchmarks/results/vllm_gpu_h100_graphs.*).
DEFAULT_STORE_PROGRAMS = 4

#: Prompts waiting to be stored when unset (see docs/architecture.md, "vLLM plug-ins").
DEFAULT_SAVE_QUEUE_DEPTH = 8


@dataclass(frozen=True)
class VllmConnectorOptions:
    """Everything the connector needs besides vLLM's own config."""

    config: KvtierConfig
    #: Identifies the weights beyond vLLM's model name, so two fine-tunes never share pages;
    #: empty: derived from the checkpoint (``fingerprint.model_fingerprint`` says how).
    model_fingerprint: str = ""
    #: kvtier page size taken from vLLM's block size (no ``page_size`` key given).
    page_size_from_block: bool = True
    #: Prompts queued for the saver thread at most; past it a prompt is not stored (counted).
    save_queue_depth: int = DEFAULT_SAVE_QUEUE_DEPTH
    #: CPU scheduling class of the saver thread and kvtier's IO threads: ``idle`` or ``normal``.
    background_priority: str = "idle"
    #: No ``staging_pages`` key given: on CUDA the runtime sizes the staging pool from vLLM's
    #: ``max_model_len`` and the free GPU memory (``runtime.default_staging_pages``).
    staging_from_default: bool = False
    #: Loads and saves move between vLLM's blocks and kvtier's host pages directly (``direct``),
    #: with no staging pages on the GPU.
    direct: bool = False

    @property
    def store(self) -> StoreConfig:
        return self.config.store


_OWN_KEYS = ("config", "model_fingerprint", "save_queue_depth", "background_priority",
             "direct")


def parse_connector_config(extra: Mapping[str, Any] | None, block_size: int,
                           env: Mapping[str, str] | None = None) -> VllmConnectorOptions:
    """Options from vLLM's extra config (``None`` gives defaults: host tier only)."""
    section = dict(extra or {})
    unknown = sorted(set(section) - set(STORE_FIELDS) - set(CONFIG_KEYS) - set(_OWN_KEYS))
    if unknown:
        allowed = ", ".join([*_OWN_KEYS, *STORE_FIELDS, *CONFIG_KEYS])
        raise ConfigError("kv_connector_extra_config", unknown, f"known keys: {allowed}")
    flags: dict[str, Any] = {f"store.{k}": v for k, v in section.items() if k in STORE_FIELDS}
    flags.update({CONFIG_KEYS[k]: v for k, v in section.items() if k in CONFIG_KEYS})
    flags.setdefault("cache.page_size", block_size)
    # Staging pages set nowhere (key, config file, KVTIER_* variable): the floor here, sized to
    # the model and the GPU when the runtime is built (``runtime.default_staging_pages``).
    set_elsewhere = explicit_paths(argparse.Namespace(config=section.get("config")), env)
    direct = section.get("direct", False)
    if not isinstance(direct, bool):
        raise ConfigError("kv_connector_extra_config.direct", direct, "true or false")
    if direct and "staging_pages" in section:
        raise ConfigError("kv_connector_extra_config.staging_pages", section["staging_pages"],
                          "left out with \"direct\": true (the direct path stages nothing)")
    staging_from_default = "staging_pages" not in section \
        and "cache.device_pages" not in set_elsewhere and not direct
    if direct:
        flags["cache.device_pages"] = DIRECT_DEVICE_PAGES
    elif staging_from_default:
        flags["cache.device_pages"] = DEFAULT_STAGING_PAGES
    if "store_programs" not in section and "host.store_programs" not in set_elsewhere:
        flags["host.store_programs"] = DEFAULT_STORE_PROGRAMS
    fingerprint = section.get("model_fingerprint", "")
    if not isinstance(fingerprint, str):
        raise ConfigError("kv_connector_extra_config.model_fingerprint", fingerprint, "a string")
    config = build_config(section.get("config"), env, flags)
    if config.host.pool_bytes == 0:
        raise ConfigError("host_pool_bytes", 0, "a host pool of at least one page: the "
                          "connector stages every hit there before claiming it")
    depth = section.get("save_queue_depth", DEFAULT_SAVE_QUEUE_DEPTH)
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
        raise ConfigError("kv_connector_extra_config.save_queue_depth", depth, "an integer >= 1")
    priority = section.get("background_priority", "idle")
    check_priority(priority)
    return VllmConnectorOptions(config=config, model_fingerprint=fingerprint,
                                page_size_from_block="page_size" not in section,
                                save_queue_depth=depth, background_priority=priority,
                                staging_from_default=staging_from_default, direct=direct)
