"""Page stores by URL: ``open_store("file:///path?max_bytes=1GiB", page_bytes=...)``.

Owns the registry from URL scheme to backend class (imported lazily, so the redis client is only
needed when a ``redis://`` URL is opened). Backends implement ``kvtier.store.base.PageStore`` and
a ``from_url(url, page_bytes, options)`` classmethod. Called on whichever thread opens a store.
"""

from __future__ import annotations

import importlib
from typing import Protocol
from urllib.parse import parse_qsl, urlsplit

from kvtier.errors import ConfigError
from kvtier.store.base import PageStore, StoreStats

#: scheme -> "module:Class"; a backend module registers here by name, imported on first use.
BACKENDS: dict[str, str] = {
    "memory": "kvtier.store.memory:MemoryStore",
    "file": "kvtier.store.file:FileStore",
    "redis": "kvtier.store.redis:RedisStore",
    "rediss": "kvtier.store.redis:RedisStore",
}


class StoreOpener(Protocol):
    """What a backend class offers besides the ``PageStore`` contract: opening by URL."""

    def from_url(self, url: str, page_bytes: int, options: dict[str, object]) -> PageStore: ...


def open_store(url: str, *, page_bytes: int, **options: object) -> PageStore:
    """Open the store a URL names; query parameters and ``options`` (which win) configure it."""
    parts = urlsplit(url)
    if parts.scheme not in BACKENDS:
        raise ConfigError("store url", url, "a URL with scheme " + ", ".join(sorted(BACKENDS)))
    module_name, _, class_name = BACKENDS[parts.scheme].partition(":")
    try:
        backend: StoreOpener = getattr(importlib.import_module(module_name), class_name)
    except ImportError as exc:
        raise ConfigError("store url", url, f"an installed backend ({exc})") from None
    merged: dict[str, object] = dict(parse_qsl(parts.query))
    merged.update(options)
    return backend.from_url(url, page_bytes, merged)


__all__ = ["BACKENDS", "PageStore", "StoreStats", "open_store"]
