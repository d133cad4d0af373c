"""Settings of ``kvtier serve`` that must take effect or be refused: sizes shown as sizes, the
running-sequence cap as a config field, no dead ``server.data_dir``, host tier checks, pools
sized to the model, and a ``make run`` that needs only the core environment."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.cli import main
from kvtier.config import build_config, iter_fields
from kvtier.errors import ConfigError
from kvtier.layout import KVLayout
from kvtier.serve.sizing import CPU_DEVICE_POOL_CAP_BYTES, CPU_HOST_POOL_CAP_BYTES, size_pools
from kvtier.units import format_size

ROOT = Path(__file__).resolve().parents[1]


def test_help_shows_sizes_in_binary_units_not_raw_bytes(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "[default: 2GiB]" in text and "[default: 64GiB]" in text
    assert "2147483648" not in text
    assert format_size(3 << 20) == "3MiB" and format_size(1000) == "1000"


def test_max_running_is_a_config_field_with_the_short_flag(capsys):
    assert main(["info", "--json", "--max-running", "7"]) == 0
    assert '"max_running": 7' in capsys.readouterr().out
    assert build_config(env={"KVTIER_ENGINE__MAX_RUNNING": "3"}).engine.max_running == 3


def test_data_dir_is_gone_and_the_dockerfile_sets_only_known_fields():
    assert "server.data_dir" not in dict(iter_fields())
    with pytest.raises(ConfigError, match="known field"):
        build_config(env={}, flags={"server.data_dir": "/data"})
    env = dict(re.findall(r"(KVTIER_[A-Z_]+)=(\S+)", (ROOT / "Dockerfile").read_text()))
    assert "KVTIER_STORE__DISK_URL" in env
    build_config(env=env)  # every variable the image sets names a field that exists


def _tiny_lm(device: str = "cpu", positions: int = 4096, layers: int = 4) -> SimpleNamespace:
    def kv_layout(page_size: int) -> KVLayout:
        return KVLayout(num_layers=layers, num_kv_heads=2, head_dim=32, dtype="float32",
                        page_size=page_size)
    return SimpleNamespace(device=device, max_positions=positions, kv_layout=kv_layout)


def test_unset_pools_are_sized_to_the_model_on_the_cpu():
    config = build_config(env={})
    sized = size_pools(config, _tiny_lm(), explicit=set())
    layout = _tiny_lm().kv_layout(config.cache.page_size)
    context = 4096 * layout.bytes_per_token  # the model's positions bound a sequence here
    running = config.engine.max_running
    assert sized.cache.device_pages * layout.page_bytes == min(running * context,
                                                               CPU_DEVICE_POOL_CAP_BYTES)
    assert sized.host.pool_bytes == min(2 * running * context, CPU_HOST_POOL_CAP_BYTES)
    assert sized.host.pool_bytes < config.host.pool_bytes


def test_pools_the_user_set_are_kept_and_cuda_keeps_its_device_share():
    config = build_config(env={}, flags={"host.pool_bytes": "1GiB"})
    kept = size_pools(config, _tiny_lm(), explicit={"host.pool_bytes", "cache.device_pages"})
    assert kept.host.pool_bytes == 1 << 30 and kept.cache.device_pages == 0
    defaults = build_config(env={}, flags={"engine.max_running": "4"})
    small = size_pools(defaults, _tiny_lm("cuda:0", 32768), explicit=set())
    assert small.cache.device_pages == 0
    assert small.host.pool_bytes == 8 * 32768 * 2048  # 2 x 4 full contexts of 2 KiB a token
    large = size_pools(defaults, _tiny_lm("cuda:0", 32768, 32), explicit=set())
    assert large.host.pool_bytes == 2 << 30  # 8 full contexts pass the default cap


@pytest.mark.parametrize(("flags", "needle"), [
    ({"host.pool_bytes": "0", "store.disk_url": "memory://d"}, "--disk (store.disk_url)"),
    ({"host.pool_bytes": "100", "store.disk_url": "memory://d"}, "at least one page"),
])
def test_store_tier_without_a_usable_host_pool_is_refused(flags, needle):
    from kvtier.cache import TieredCache
    from kvtier.keys import KeyNamespace

    layout = _tiny_lm().kv_layout(16)
    config = build_config(env={}, flags={"cache.page_size": 16, "cache.device_pages": 8, **flags})
    namespace = KeyNamespace("m", "fp", "float32", layout.fingerprint(), 16)
    with pytest.raises(ConfigError) as info:
        TieredCache.build(config, layout, namespace)
    assert "--host-pool-bytes (host.pool_bytes)" in str(info.value)
    assert needle in str(info.value)


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_run_needs_only_the_core_environment():
    def commands(target: str) -> str:
        return subprocess.run(["make", "-C", str(ROOT), "-n", "-B", target], check=True,
                              capture_output=True, text=True).stdout
    run, test = commands("run"), commands("test")
    assert "kvtier serve" in run
    for test_only in ("setup_sglang_env", ".[test]", "install_system_deps"):
        assert test_only not in run and test_only in test


@pytest.mark.parametrize(("flags", "words"), [
    ({"store.disk_url": "/var/cache/kvtier"}, ["--disk (store.disk_url)",
                                               "file:///var/cache/kvtier"]),
    ({"store.disk_url": "file://relative/dir"}, ["--disk (store.disk_url)", "host part"]),
    ({"store.remote_url": "valkey://h:6379"}, ["--redis (store.remote_url)", "scheme"]),
    ({"store.disk_url": "file:///d", "cache.enabled": "false"}, ["--no-cache",
                                                                 "--disk (store.disk_url)"]),
    ({"store.remote_url": "redis://h:6379/0", "host.pool_bytes": "0"},
     ["--host-pool-bytes (host.pool_bytes)", "--redis (store.remote_url)"]),
])
def test_preflight_refuses_what_cannot_take_effect_naming_the_settings(flags, words):
    from kvtier.serve.preflight import check_settings

    with pytest.raises(ConfigError) as info:
        check_settings(build_config(env={}, flags=flags))
    assert all(word in str(info.value) for word in words), str(info.value)


def test_preflight_accepts_working_store_settings_and_binds_a_free_port():
    from kvtier.serve.preflight import bind_listener, check_settings

    check_settings(build_config(env={}, flags={"store.disk_url": "file:///tmp/kvtier-x",
                                               "store.remote_url": "redis://:pw@h:6379/0"}))
    with bind_listener("127.0.0.1", 0) as sock, pytest.raises(ConfigError, match="in use"):
        bind_listener("127.0.0.1", sock.getsockname()[1])
