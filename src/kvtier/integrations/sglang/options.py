"""Options of kvtier's SGLang storage backend, read from SGLang's extra storage config.

Owns ``SGLangBackendOptions`` (frozen) and ``parse_extra_config``. SGLang passes one JSON object
(``--hicache-storage-backend-extra-config``); its own keys (``backend_name``, ``module_path``,
``class_name``, ``interface_v1``, ...) stay at the top level and kvtier's live under ``"kvtier"``,
checked strictly, so a typo is refused at start-up with the field, the value and what is allowed::

    {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
     "class_name": "KvtierHiCacheStorage", "interface_v1": 1,
     "kvtier": {"disk_url": "file:///nvme/kvtier", "disk_max_bytes": "500GiB",
                "remote_url": "redis://:secret@10.0.0.5:6379/0"}}

The store fields are kvtier's own ``store`` config section (same names, checks and defaults as
``kvtier info`` shows); ``config`` names a kvtier YAML file read first, and ``KVTIER_STORE__*``
environment variables apply as everywhere else. Pure Python, no torch or SGLang imports; runs on
the thread that constructs the backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvtier.config import StoreConfig, build_config
from kvtier.errors import ConfigError
from kvtier.units import parse_size

#: Fields of kvtier's ``store`` config section accepted under ``"kvtier"``.
STORE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(StoreConfig))


@dataclass(frozen=True)
class SGLangBackendOptions:
    """Everything kvtier's SGLang backend needs besides SGLang's own storage config."""

    store: StoreConfig
    #: Identifies the model's weights beyond SGLang's model name (two fine-tunes never share);
    #: empty: derived from the checkpoint the model path names (``keys.default_fingerprint``).
    model_fingerprint: str = ""
    #: KV heads of the whole model; lets TP ranks that replicate heads share one page.
    kv_heads_total: int | None = None
    #: Put each page shape in its own subdirectory of a ``file://`` store.
    layout_subdir: bool = True
    #: Bytes of the staging buffer one thread uses to reorder pages between pool and store.
    staging_bytes: int = 64 << 20
    #: Copy pages found only in the remote tier into the disk tier.
    promote: bool = True
    #: Use SGLang's batch_get_v1/batch_set_v1 (SGLang reads this from the top level too).
    interface_v1: bool = False

    @property
    def store_urls(self) -> dict[str, str]:
        """The configured tiers, nearest first: {"disk": url, "remote": url}."""
        urls = {"disk": self.store.disk_url, "remote": self.store.remote_url}
        return {tier: url for tier, url in urls.items() if url}


_OWN_FIELDS = {f.name for f in fields(SGLangBackendOptions)} - {"store", "interface_v1"}


def parse_extra_config(extra: Mapping[str, Any] | None,
                       env: Mapping[str, str] | None = None) -> SGLangBackendOptions:
    """Build the options from SGLang's extra config dict (``None`` gives defaults)."""
    extra = dict(extra or {})
    section = extra.get("kvtier", {})
    if not isinstance(section, Mapping):
        raise ConfigError("kvtier", section, "an object of kvtier backend settings")
    section = dict(section)
    config_file = section.pop("config", None)
    unknown = sorted(set(section) - set(STORE_FIELDS) - _OWN_FIELDS)
    if unknown:
        allowed = ", ".join(["config", *STORE_FIELDS, *sorted(_OWN_FIELDS)])
        raise ConfigError("kvtier", unknown, f"known settings: {allowed}")
    flags = {f"store.{name}": section.pop(name) for name in list(section) if name in STORE_FIELDS}
    store = build_config(config_file, env, flags).store
    if not store.disk_url and not store.remote_url:
        raise ConfigError("kvtier.disk_url", "", "a store URL in disk_url or remote_url "
                          "(file:///path, redis://host:port/db or memory://name)")
    return SGLangBackendOptions(
        store=store,
        model_fingerprint=_text("model_fingerprint", section.get("model_fingerprint", "")),
        kv_heads_total=_optional_positive("kv_heads_total", section.get("kv_heads_total")),
        layout_subdir=_flag("layout_subdir", section.get("layout_subdir", True)),
        staging_bytes=_size("staging_bytes", section.get("staging_bytes", 64 << 20)),
        promote=_flag("promote", section.get("promote", True)),
        interface_v1=_flag("interface_v1", extra.get("interface_v1", False)),
    )


def _text(name: str, raw: Any) -> str:
    if not isinstance(raw, str):
        raise ConfigError(f"kvtier.{name}", raw, "a string")
    return raw


def _flag(name: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, int) and raw in (0, 1):
        return bool(raw)
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"kvtier.{name}", raw, "true or false")


def _size(name: str, raw: Any) -> int:
    value = raw if isinstance(raw, int) and not isinstance(raw, bool) else parse_size(str(raw))
    if value is None or value < 1:
        raise ConfigError(f"kvtier.{name}", raw, "a byte count such as 64MiB")
    return value


def _optional_positive(name: str, raw: Any) -> int | None:
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        raise ConfigError(f"kvtier.{name}", raw, "a positive integer, or null")
    return raw
