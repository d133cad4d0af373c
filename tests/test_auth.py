"""Who may call what: the admin key, the metrics key, keys that must differ, loopback by default."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kvtier.config import build_config
from kvtier.errors import ConfigError
from kvtier.serve.auth import bearer_matches, check_exposure
from test_engine_support import make_config, tiny_lm

ADMIN = "admin-" + "a" * 24
API = "api-" + "b" * 24


@contextmanager
def client(**flags: Any) -> Iterator[Any]:
    """An in-process client of the whole app (no socket), cache off."""
    from fastapi.testclient import TestClient

    from kvtier.engine.service import EngineService
    from kvtier.serve.app import create_app

    config = make_config(cache__enabled="false", **flags)
    service = EngineService.build(config, lm=tiny_lm(), max_running=1)
    try:
        with TestClient(create_app(service, config)) as http:
            yield http
    finally:
        service.close()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_admin_api_is_disabled_with_a_reason_when_no_admin_key_is_set() -> None:
    with client() as http:
        for method, path in (("get", "/admin/storage"), ("post", "/admin/flush"),
                             ("get", "/admin/stats"), ("delete", "/admin/storage?tier=disk")):
            resp = getattr(http, method)(path, headers=bearer("anything"))
            assert resp.status_code == 403, path
            error = resp.json()["error"]
            assert error["code"] == "admin_disabled" and "server.admin_key" in error["message"]


def test_admin_routes_need_exactly_the_admin_key() -> None:
    with client(server__admin_key=ADMIN, server__api_key=API) as http:
        missing = http.get("/admin/stats")
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert missing.json()["error"]["code"] == "invalid_admin_key"
        for wrong in (bearer(API), bearer(ADMIN + "x"), bearer(ADMIN[:-1]),
                      {"Authorization": f"Basic {ADMIN}"}, {"Authorization": ADMIN}):
            assert http.get("/admin/stats", headers=wrong).status_code == 401, wrong
        assert http.get("/admin/stats", headers=bearer(ADMIN)).status_code == 200


def test_the_admin_key_does_not_open_the_openai_routes_and_vice_versa() -> None:
    with client(server__admin_key=ADMIN, server__api_key=API) as http:
        assert http.get("/v1/models", headers=bearer(ADMIN)).status_code == 401
        assert http.get("/v1/models", headers=bearer(API)).status_code == 200
        assert http.post("/admin/flush", headers=bearer(API)).status_code == 401


def test_metrics_are_open_without_an_api_key_and_need_a_key_with_one() -> None:
    with client() as http:
        assert http.get("/metrics").status_code == 200
    with client(server__api_key=API, server__admin_key=ADMIN) as http:
        refused = http.get("/metrics")
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
        assert http.get("/metrics", headers=bearer(API)).status_code == 200
        assert http.get("/metrics", headers=bearer(ADMIN)).status_code == 200
        assert http.get("/health").status_code == 200


def test_an_admin_key_equal_to_the_api_key_is_refused_at_start() -> None:
    with pytest.raises(ConfigError, match="different from server.api_key"), \
            client(server__admin_key=ADMIN, server__api_key=ADMIN):
        pass


def test_bearer_comparison_is_exact_and_an_empty_key_never_matches() -> None:
    assert bearer_matches(f"Bearer {ADMIN}", ADMIN)
    assert not bearer_matches(f"bearer {ADMIN}", ADMIN)
    assert not bearer_matches(f"Bearer {ADMIN} ", ADMIN)
    assert not bearer_matches("Bearer ", "")
    assert not bearer_matches(None, ADMIN)


def test_server_binds_to_loopback_by_default_and_warns_when_exposed_without_a_key() -> None:
    config = build_config(env={})
    assert config.server.host == "127.0.0.1" and check_exposure(config) == []
    exposed = build_config(env={}, flags={"server.host": "0.0.0.0", "server.admin_key": "short"})
    warnings = check_exposure(exposed)
    assert any("beyond loopback" in w for w in warnings)
    assert any("shorter than 16" in w for w in warnings)
    guarded = build_config(env={}, flags={"server.host": "0.0.0.0", "server.api_key": API})
    assert check_exposure(guarded) == []
