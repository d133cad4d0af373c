"""What ``kvtier serve`` checks before the model loads, and the socket it binds first.

Owns ``check_settings(config)``: a configured tier that cannot take effect (a disk or Redis tier
with the host tier off or the cache off) and a store URL that cannot open (a plain path, an
unknown scheme, a ``file://`` URL with a host part) are refused with a ``ConfigError`` naming
each setting as a user writes it (``--disk (store.disk_url)``), before the model spends seconds
or minutes loading. And ``bind_listener(host, port)``: the server's socket, bound and listening
before the model loads, so a port in use fails at once and the "serving at" banner can wait for
a socket that accepts. Main thread; no web framework imports.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

from kvtier.config import KvtierConfig, setting_name
from kvtier.errors import ConfigError

#: Connections the kernel queues before the server accepts them (uvicorn's default).
LISTEN_BACKLOG = 2048
STORE_FIELDS = ("store.disk_url", "store.remote_url")


def check_settings(config: KvtierConfig) -> None:
    """Raise ``ConfigError`` for a store URL that cannot open or a tier that cannot serve."""
    for path in STORE_FIELDS:
        url = getattr(config.store, path.split(".")[1])
        if url:
            check_store_url(path, url)
    configured = [setting_name(p) for p in STORE_FIELDS if getattr(config.store, p.split(".")[1])]
    if not configured:
        return
    tiers = " and ".join(configured)
    if not config.cache.enabled:
        raise ConfigError("cache.enabled (--no-cache)", False,
                          f"true while {tiers} is set: with the cache off no tier is used "
                          "(drop the store URL to run the baseline)")
    if config.host.pool_bytes == 0:
        raise ConfigError(setting_name("host.pool_bytes"), 0,
                          f"a host pool while {tiers} is set: stores exchange pages with the "
                          "host tier only (give the host pool bytes, or drop the store URL)")


def check_store_url(path: str, url: str) -> None:
    """Refuse a store URL ``open_store`` could not open, naming the setting."""
    from kvtier.store import BACKENDS  # the registry only: no backend is imported

    parts = urlsplit(url)
    name = setting_name(path)
    if parts.scheme not in BACKENDS:
        hint = f" (for a directory: file://{os.path.abspath(url)})" if "://" not in url else ""
        raise ConfigError(name, url, "a URL with scheme " + ", ".join(sorted(BACKENDS)) + hint)
    if parts.scheme == "file" and (parts.netloc not in ("", "localhost") or not parts.path):
        raise ConfigError(name, url, "file:///absolute/path (three slashes: a file URL has no "
                          f"host part, and {parts.netloc!r} would be one)")


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening; ``ConfigError`` naming
    ``--port`` / ``--host`` when it cannot be had."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ConfigError(setting_name("server.host"), host,
                          f"an address of this machine ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise ConfigError(setting_name("server.port"), port,
                          f"a port free on {host} ({exc.strerror}: another process listens "
                          "there; stop it or choose another port)") from None
    return sock
