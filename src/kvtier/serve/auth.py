"""Who may call what: the API key of ``/v1/*``, the admin key of ``/admin/*``, the key of
``/metrics``, start-up warnings.

Owns ``bearer_matches`` (constant-time comparison of an ``Authorization`` header with a key),
``ApiKeyGuard`` (a pure ASGI middleware), ``admin_guard(config)`` and ``metrics_guard(config)``
(FastAPI dependencies) and ``check_exposure(config)``. The rules:

- ``/v1/*`` needs ``Authorization: Bearer <server.api_key>`` when that key is set; otherwise
  401 ``invalid_api_key``, before the body is read or a request slot taken.
- ``/admin/*`` needs ``Authorization: Bearer <server.admin_key>``. With no admin key configured
  the admin API is disabled: every admin route answers 403 ``admin_disabled`` and says how to
  enable it (never open, and never a bare 404 that looks like a missing route). A missing or
  wrong key answers 401 ``invalid_admin_key`` with ``WWW-Authenticate: Bearer``.
- The admin key must differ from the OpenAI ``server.api_key`` (refused at start-up): otherwise
  every API client could wipe storage.
- ``/metrics`` is open when ``server.api_key`` is empty (a loopback server, like ``/health``);
  with an API key set it needs that key or the admin key.

Runs on the server's event loop. (No ``from __future__ import annotations``: FastAPI reads the
guards' annotations, and ``Request`` is imported lazily inside the factories.)
"""

import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kvtier.config import KvtierConfig
from kvtier.errors import ConfigError
from kvtier.serve.errors import APIError
from kvtier.serve.limits import answer

log = logging.getLogger("kvtier.serve")

MIN_KEY_CHARS = 16
ADMIN_DISABLED = ("the admin API is disabled: no admin key is configured. Set server.admin_key "
                  "(KVTIER_SERVER__ADMIN_KEY or --server.admin_key) and send 'Authorization: "
                  "Bearer KEY'")


def bearer_matches(header: str | None, key: str) -> bool:
    """True when ``header`` is exactly ``Bearer <key>`` (compared in constant time)."""
    if not key or not header:
        return False
    return hmac.compare_digest(header.encode(), f"Bearer {key}".encode())


class AuthError(APIError):
    """401 with the ``WWW-Authenticate`` challenge."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(401, message, code=code)
        self.headers = {"WWW-Authenticate": "Bearer"}


class ApiKeyGuard:
    """ASGI middleware: ``/v1/*`` needs the API key when one is configured."""

    def __init__(self, app: Any, *, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.api_key and scope["type"] == "http" and scope.get("path", "").startswith("/v1/"):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not bearer_matches(given.decode("latin-1"), self.api_key):
                await answer(send, APIError(401, "missing or wrong API key (send "
                                            "'Authorization: Bearer KEY')",
                                            code="invalid_api_key"), {})
                return
        await self.app(scope, receive, send)


def admin_guard(config: KvtierConfig) -> Callable[..., Awaitable[None]]:
    """A dependency for the admin router: 403 when disabled, 401 without the right key."""
    from fastapi import Depends, Request
    from fastapi.security import HTTPBearer

    key = config.server.admin_key
    scheme = HTTPBearer(auto_error=False, scheme_name="adminKey",
                        description="server.admin_key as a bearer token")

    async def guard(request: Request, _credentials: Any = Depends(scheme)) -> None:
        if not key:
            raise APIError(403, ADMIN_DISABLED, code="admin_disabled")
        if not bearer_matches(request.headers.get("authorization"), key):
            raise AuthError("missing or wrong admin key (send 'Authorization: Bearer "
                            "ADMIN_KEY')", "invalid_admin_key")

    return guard


def metrics_guard(config: KvtierConfig) -> Callable[..., Awaitable[None]]:
    """A dependency for ``/metrics``: open without an API key, else the API or admin key."""
    from fastapi import Request

    keys = [k for k in (config.server.api_key, config.server.admin_key) if k]
    open_access = not config.server.api_key

    async def guard(request: Request) -> None:
        if open_access:
            return
        given = request.headers.get("authorization")
        if not any(bearer_matches(given, k) for k in keys):
            raise AuthError("missing or wrong key for /metrics (send 'Authorization: Bearer "
                            "KEY' with the API key or the admin key)", "invalid_api_key")

    return guard


def check_exposure(config: KvtierConfig) -> list[str]:
    """Refuse an admin key equal to the API key; return warnings (also logged) about keys and
    binding beyond loopback."""
    server = config.server
    if server.admin_key and server.admin_key == server.api_key:
        raise ConfigError("server.admin_key", "***", "a key different from server.api_key")
    warnings = []
    if server.admin_key and len(server.admin_key) < MIN_KEY_CHARS:
        warnings.append(f"server.admin_key is shorter than {MIN_KEY_CHARS} characters; use a "
                        "long random key")
    if not _is_loopback(server.host) and not server.api_key:
        warnings.append(f"serving on {server.host} (beyond loopback) with no server.api_key: "
                        "anyone who reaches the port can run requests")
    for warning in warnings:
        log.warning(warning)
    return warnings


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
