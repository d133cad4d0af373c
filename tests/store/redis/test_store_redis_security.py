"""Credentials and TLS through the store URL: ``requirepass``, ACL users, ``rediss://``.

A wrong or missing password must be a clear ``StoreUnavailable`` at open, never silent misses,
and the password must not leak into the store's URL or error messages.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import StoreUnavailable
from kvtier.store import open_store
from kvtier.store.redis import RedisStore
from redis_server import OPENSSL, RedisServer, make_tls_material, needs_redis, running_server
from store_contract import key_for, page_bytes_for

pytestmark = [needs_redis, pytest.mark.redis]

PAGE = 4099
SECRET = "s3cret-pass"


@pytest.fixture(scope="module")
def locked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_server(tmp_path_factory.mktemp("redis-auth"), password=SECRET) as server:
        with server.client() as admin:
            admin.execute_command("ACL", "SETUSER", "kvuser", "on", ">userpass", "~acl:*",
                                  "+get", "+set", "+exists", "+del", "+info", "+dbsize", "+scan",
                                  "+ping")
        yield server


def round_trip(url: str, prefix: str) -> None:
    with open_store(url, page_bytes=PAGE, prefix=prefix, timeout_s=2) as store:
        assert isinstance(store, RedisStore)
        page = page_bytes_for(7, PAGE)
        assert store.write([key_for(7)], [page]) == [True]
        out = np.zeros(PAGE, np.uint8)
        assert store.read_into([key_for(7)], [out]) == [True]
        assert out.tobytes() == page


def test_right_password_opens_and_round_trips(locked: RedisServer) -> None:
    round_trip(locked.url(), "auth:")


def test_wrong_password_is_a_clear_error_at_open(locked: RedisServer) -> None:
    with pytest.raises(StoreUnavailable, match="refused") as caught:
        open_store(locked.url(password="nope"), page_bytes=PAGE)
    assert "nope" not in str(caught.value)


def test_missing_password_is_a_clear_error_at_open(locked: RedisServer) -> None:
    url = f"redis://127.0.0.1:{locked.port}/0"
    with pytest.raises(StoreUnavailable, match="(?i)password"):
        open_store(url, page_bytes=PAGE)


def test_acl_user_opens_within_its_key_pattern(locked: RedisServer) -> None:
    round_trip(locked.url(user="kvuser", password="userpass"), "acl:")


def test_acl_user_with_a_wrong_password_is_refused(locked: RedisServer) -> None:
    with pytest.raises(StoreUnavailable, match="refused"):
        open_store(locked.url(user="kvuser", password="wrong"), page_bytes=PAGE)


def test_password_is_redacted_from_the_store_url(locked: RedisServer) -> None:
    with open_store(locked.url(), page_bytes=PAGE) as store:
        assert isinstance(store, RedisStore)
        assert SECRET not in store.url and "***" in store.url


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if OPENSSL is None:
        pytest.skip("the openssl binary is needed to make test certificates")
    workdir = tmp_path_factory.mktemp("redis-tls")
    material = make_tls_material(workdir / "certs")
    with running_server(workdir / "data", tls=material, password=SECRET) as server:
        yield server


def test_rediss_url_with_the_ca_round_trips_over_tls(tls_server: RedisServer) -> None:
    ca = tls_server.tls["ca"] if tls_server.tls else Path()
    round_trip(tls_server.url(query=f"ssl_ca_certs={ca}"), "tls:")


def test_rediss_url_without_a_trusted_ca_is_refused_at_open(tls_server: RedisServer) -> None:
    with pytest.raises(StoreUnavailable):
        open_store(tls_server.url(), page_bytes=PAGE, timeout_s=2)


def test_plain_redis_url_against_a_tls_port_is_refused_at_open(tls_server: RedisServer) -> None:
    url = f"redis://:{SECRET}@127.0.0.1:{tls_server.port}/0"
    with pytest.raises(StoreUnavailable):
        open_store(url, page_bytes=PAGE, timeout_s=1)
