"""Options of kvtier's vLLM connector, read from ``kv_connector_extra_config``.

Owns ``VllmConnectorOptions`` (frozen) and ``parse_connector_config``. vLLM hands the connector
one flat JSON object; every key is checked, so a typo is refused at start naming the key, the
value and what is allowed::

    {"disk_url": "file:///nvme/kvtier", "remote_url": "redis://10.0.0.5:6379/0",
     "page_size": 64, "host_pool_bytes": "4GiB", "staging_pages": 512,
     "save_queue_depth": 8, "background_priority": "idle", "direct": "auto"}

Store keys are the fields of kvtier's ``store`` config section (same names, checks and defaults);
``config`` names a kvtier YAML file read first, and ``KVTIER_*`` environment variables apply as
everywhere else. ``model_fingerprint`` names the weights in every page key: left out, it is
derived from the checkpoint vLLM loads (``kvtier.integrations.vllm.fingerprint``: config.json
plus each weight file's name, size, header and sampled blocks, a few MiB read at start even for
a 70B checkpoint), so a fine-tune written over its base never reads the base's pages; set it to
make two checkpoints share pages on purpose, or where kvtier cannot read the weights.
``direct`` picks the path a hit and a save take between vLLM's blocks and kvtier's host tier:
``true`` straight there, beside the forward (``integrations.vllm.direct``); ``false`` through
kvtier's staging pages on the GPU, inside the step; ``"auto"`` (the default) the direct path
wherever it applies (``resolve_direct``). Pure Python, no torch or vLLM imports; runs on the
thread that builds the connector.
"""

from __future__ import annotations

import argparse
import dataclasses
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
    #: with no staging pages on the GPU: True, False, or None (``"auto"``: decided when the
    #: runtime is built, ``resolve_direct``).
    direct: bool | None = None

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
    direct = section.get("direct", "auto")
    if not isinstance(direct, bool) and direct != "auto":
        raise ConfigError("kv_connector_extra_config.direct", direct, "true, false or \"auto\"")
    direct = None if direct == "auto" else direct
    if direct and "staging_pages" in section:
        raise ConfigError("kv_connector_extra_config.staging_pages", section["staging_pages"],
                          "left out with \"direct\": true (the direct path stages nothing)")
    staging_from_default = "staging_pages" not in section \
        and "cache.device_pages" not in set_elsewhere and direct is not True
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


def resolve_direct(options: VllmConnectorOptions, device: str, ranked: bool,
                   block_size: int) -> bool:
    """Whether the connector takes the direct path. ``"auto"`` takes it where it was measured
    to serve better than the staged path (an H100, vLLM 0.26, CUDA graphs: shared-prefix
    TTFT p50 0.86x the staged path's and 0.93x vLLM's native offloading's, multi-turn 0.78x
    and 1.02x, the same throughput; ``benchmarks/results/vllm_serve_h100_direct_ce.txt``) and
    where its copies are the fast ones: a CUDA device, one worker in the engine-core process
    (workers in processes of their own share staging pages, not kvtier's host tier), kvtier's
    page one vLLM block (the row kernel moves whole blocks), and no staging pages asked for.
    vLLM's CPU backend keeps the staged path (its saver thread copies outside the step)."""
    if options.direct is not None:
        return options.direct
    return (device.startswith("cuda") and not ranked and options.staging_from_default
            and options.config.cache.page_size == block_size)


def with_direct(options: VllmConnectorOptions, direct: bool) -> VllmConnectorOptions:
    """``options`` with the path decided (``resolve_direct``); the direct path keeps the
    least device pool (``DIRECT_DEVICE_PAGES``) and sizes no staging pages."""
    if not direct:
        return dataclasses.replace(options, direct=False)
    options = with_staging_pages(options, DIRECT_DEVICE_PAGES)
    return dataclasses.replace(options, direct=True, staging_from_default=False)


def with_staging_pages(options: VllmConnectorOptions, pages: int) -> VllmConnectorOptions:
    config = options.config
    cache = dataclasses.replace(config.cache, device_pages=pages)
    return dataclasses.replace(options, config=dataclasses.replace(config, cache=cache))
