"""Config: precedence (defaults < file < env < flags) and every validation error path."""

from __future__ import annotations

import pytest

from kvtier.cli import build_parser
from kvtier.config import KvtierConfig, build_config, to_dict
from kvtier.errors import ConfigError
from kvtier.units import parse_size


def test_defaults_when_nothing_given():
    assert build_config(env={}) == KvtierConfig()


def test_file_then_env_then_flags(tmp_path):
    path = tmp_path / "kvtier.yaml"
    path.write_text("server:\n  port: 9001\n  host: 0.0.0.0\ncache:\n  page_size: 32\n"
                    "host:\n  pool_bytes: 1GiB\n")
    env = {"KVTIER_SERVER__PORT": "9002", "KVTIER_CACHE__PAGE_SIZE": "16"}
    flags = {"server.port": "9003"}
    config = build_config(path, env, flags)
    assert config.server.port == 9003          # flag beats env and file
    assert config.cache.page_size == 16        # env beats file
    assert config.server.host == "0.0.0.0"     # file beats default
    assert config.host.pool_bytes == 1 << 30   # size suffix
    assert config.engine.model == "tiny-llama"  # default


def test_env_without_double_underscore_is_ignored():
    assert build_config(env={"KVTIER_PORT": "1"}) == KvtierConfig()


@pytest.mark.parametrize("path,value,needle", [
    ("server.port", "70000", "65535"),
    ("server.port", "eighty", "integer"),
    ("cache.page_size", "0", "from 1 to 4096"),
    ("controller.min_prefetch_tokens", "-5", ">= 0"),
    ("controller.write_policy", "write_around", "write_through"),
    ("host.pool_bytes", "lots", "byte count"),
    ("host.prefetch_share", "1.5", "0.0 to 1.0"),
    ("host.prefetch_share", "nan", "number"),
    ("cache.enabled", "maybe", "true or false"),
    ("engine.colour", "red", "known field"),
])
def test_bad_value_names_field_value_and_allowed(path, value, needle):
    with pytest.raises(ConfigError) as info:
        build_config(env={}, flags={path: value})
    message = str(info.value)
    assert path.split(".")[-1] in message and value in message and needle in message
    assert isinstance(info.value, ValueError)


def test_bad_value_in_env_is_caught():
    with pytest.raises(ConfigError, match="server.port"):
        build_config(env={"KVTIER_SERVER__PORT": "-1"})


def test_bad_yaml_files(tmp_path):
    cases = {"list.yaml": "- 1\n- 2\n", "section.yaml": "nosuch:\n  a: 1\n",
             "body.yaml": "server: 3\n", "syntax.yaml": "server: [\n",
             "type.yaml": "server:\n  port: [1]\n"}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError):
            build_config(tmp_path / name, env={})
    with pytest.raises(ConfigError, match="readable"):
        build_config(tmp_path / "missing.yaml", env={})


def test_empty_yaml_file_is_defaults(tmp_path):
    (tmp_path / "empty.yaml").write_text("")
    assert build_config(tmp_path / "empty.yaml", env={}) == KvtierConfig()


def test_bool_yaml_scalar_rejected_for_int():
    with pytest.raises(ConfigError):
        build_config(env={}, flags={"server.port": True})


@pytest.mark.parametrize("text,expected", [("123", 123), ("4GiB", 4 << 30), ("512MB", 512 * 10**6),
                                           ("1.5KiB", 1536), ("2 g", 2 * 10**9), ("x", None),
                                           ("5 parsecs", None)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_cli_flags_and_aliases_reach_config():
    from kvtier.config_flags import config_from_args

    args = build_parser().parse_args(["info", "--model", "tiny-qwen2", "--server.port", "1234"])
    config = config_from_args(args, env={})
    assert (config.engine.model, config.server.port) == ("tiny-qwen2", 1234)


def test_secrets_are_redacted():
    config = build_config(env={}, flags={"server.admin_key": "hunter2",
                                         "store.remote_url": "redis://:pw@localhost:6379/0"})
    shown = to_dict(config)
    assert shown["server"]["admin_key"] == "***"
    assert "pw" not in shown["store"]["remote_url"]
    assert to_dict(config, redact=False)["server"]["admin_key"] == "hunter2"


def test_frozen():
    with pytest.raises(AttributeError):
        KvtierConfig().server.port = 1  # type: ignore[misc]
