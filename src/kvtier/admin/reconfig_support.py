"""Pieces of runtime reconfiguration that hold no state: errors, store opening, usage and health.

Owns ``Busy``, ``NotAttached`` and ``Unsupported`` (what a refused change raises; the server maps
them to 409, 404 and 400), ``open_tier_store`` (a store for one tier, with the config's defaults
for that tier, as ``TieredCache.build`` opens its configured stores), ``redact_store_url`` and
``describe_url`` (passwords, also in the query, become ``***``), ``usage_and_health`` and
``Paused`` (keeps new IO off a store for a block). Engine thread, except ``usage_and_health``
(any thread: stores are thread-safe).
"""

from __future__ import annotations

import dataclasses
from urllib.parse import parse_qsl, urlencode, urlsplit

from kvtier.config import KvtierConfig
from kvtier.errors import KvtierError
from kvtier.layout import KVLayout
from kvtier.store.base import PageStore
from kvtier.units import redact_url

STORE_TIERS = ("disk", "remote")
TIER_SCHEMES = {"disk": ("file", "memory"), "remote": ("redis", "rediss", "memory")}
SECRET_WORDS = ("password", "secret", "token")


class Busy(KvtierError, RuntimeError):
    """The change cannot happen now (the tier is in use, or already bound); retry later."""


class NotAttached(KvtierError, LookupError):
    """No store is attached to that tier."""


class Unsupported(KvtierError, ValueError):
    """The request cannot be met as asked (the message says why and what to do instead)."""


def open_tier_store(config: KvtierConfig, layout: KVLayout, tier: str, url: str,
                    max_bytes: int | None = None) -> PageStore:
    """Open ``url`` for ``tier``: the config's defaults for that tier, then the URL's query,
    then ``max_bytes``. Raises ``Unsupported`` for a scheme the tier does not take."""
    from kvtier.controller.wiring import open_stores
    from kvtier.store import open_store

    if tier not in TIER_SCHEMES:
        raise Unsupported(f"tier must be one of {', '.join(STORE_TIERS)}, got {tier!r}")
    scheme = urlsplit(url).scheme
    if scheme not in TIER_SCHEMES[tier]:
        raise Unsupported(f"the {tier} tier takes {', '.join(TIER_SCHEMES[tier])} URLs, got "
                          f"{scheme or 'no scheme'!r}")
    if max_bytes is not None and scheme not in ("file", "memory"):
        raise Unsupported("max_bytes caps a file or memory store; a redis server's cap is its "
                          "maxmemory")
    if scheme == "memory":
        caps = {} if max_bytes is None else {"max_bytes": max_bytes}
        return open_store(url, page_bytes=layout.page_bytes, **caps)
    store = dataclasses.replace(config.store, disk_url=url if tier == "disk" else "",
                                remote_url=url if tier == "remote" else "")
    if max_bytes is not None:
        store = dataclasses.replace(store, disk_max_bytes=max_bytes)
    tier_config = dataclasses.replace(config, store=store)
    return open_stores(tier_config, layout)[tier]


def redact_store_url(url: str) -> str:
    """``url`` with its password and any secret-looking query value (``ssl_password=...``)
    replaced by ``***``."""
    parts = urlsplit(redact_url(url))
    if not parts.query:
        return parts.geturl()
    pairs = [(k, "***" if any(w in k.lower() for w in SECRET_WORDS) else v)
             for k, v in parse_qsl(parts.query, keep_blank_values=True)]
    return parts._replace(query=urlencode(pairs, safe="*")).geturl()


def describe_url(store: PageStore) -> str:
    """A store's URL with secrets redacted, as far as the store lets us know it."""
    url = getattr(store, "url", None)
    if url:
        return redact_store_url(str(url))
    root = getattr(store, "root", None)
    if root is not None:
        return f"file://{root}"
    return f"{getattr(store, 'scheme', 'store')}://{getattr(store, 'name', '') or ''}"


def usage_and_health(store: PageStore) -> dict[str, object]:
    """Backend, pages, bytes, cap and counters of a store, and whether it answers."""
    try:
        stats = store.stats()
    except Exception as exc:
        return {"backend": store.scheme, "healthy": False,
                "problem": f"{type(exc).__name__}: {exc}"}
    row = {"backend": stats.backend, "pages": stats.pages, "bytes": stats.bytes,
           "capacity_bytes": stats.capacity_bytes, "healthy": True,
           "errors": stats.errors, "corrupt": stats.corrupt, "refused": stats.refused}
    servers = getattr(store, "server_info", None)
    if callable(servers):
        unreachable = [s.get("endpoint") for s in servers() if not s.get("reachable")]
        if unreachable:
            row.update(healthy=False, problem=f"unreachable: {', '.join(map(str, unreachable))}")
    return row


class Paused:
    """Take a store out of ``stores`` for a block (no new job starts on it); put it back after
    the block if the block failed, or always when ``restore`` is set."""

    def __init__(self, stores: dict[str, PageStore], tier: str, store: PageStore,
                 restore: bool) -> None:
        self.stores, self.tier, self.store, self.restore = stores, tier, store, restore

    def __enter__(self) -> None:
        self.stores.pop(self.tier, None)

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is not None or self.restore:
            self.stores[self.tier] = self.store
