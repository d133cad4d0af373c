"""The vLLM connector's own defaults: the staging pool sized to the model and the GPU, and the
small grid of its saves' GPU -> host copies.

``options.parse_connector_config`` says whether a setting was made anywhere (the connector key,
a kvtier config file, a ``KVTIER_*`` variable); ``runtime.default_staging_pages`` sizes the
pool. Pure Python: runs without vLLM.
"""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.options import (
    DEFAULT_STAGING_PAGES,
    DIRECT_DEVICE_PAGES,
    parse_connector_config,
    resolve_direct,
    with_direct,
    with_staging_pages,
)
from kvtier.integrations.vllm.runtime import default_staging_pages
from kvtier.layout import KVLayout

# llama3-8b's KV at vLLM's block of 16 tokens: 2 MiB a page.
LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)
GIB = 1 << 30


def test_unset_staging_is_marked_for_sizing_and_starts_at_the_floor() -> None:
    options = parse_connector_config({"host_pool_bytes": "1GiB"}, 16, env={})
    assert options.staging_from_default
    assert options.config.cache.device_pages == DEFAULT_STAGING_PAGES


def test_staging_set_by_key_or_environment_is_kept() -> None:
    keyed = parse_connector_config({"staging_pages": 100}, 16, env={})
    assert not keyed.staging_from_default and keyed.config.cache.device_pages == 100
    env = parse_connector_config({}, 16, env={"KVTIER_CACHE__DEVICE_PAGES": "300"})
    assert not env.staging_from_default and env.config.cache.device_pages == 300


def test_default_holds_two_prompts_of_the_longest_context() -> None:
    # 32k tokens = 2048 pages; two prompts = 4096 pages = 8 GiB, with 40 GiB free.
    assert default_staging_pages(32768, LAYOUT, 40 * GIB) == 4096
    # A context shorter than the floor keeps the floor.
    assert default_staging_pages(2048, LAYOUT, 40 * GIB) == DEFAULT_STAGING_PAGES


def test_default_takes_at_most_half_the_free_gpu_memory() -> None:
    # 4 GiB free: at most 2 GiB of staging = 1024 pages, though 128k tokens would want 16384.
    assert default_staging_pages(131072, LAYOUT, 4 * GIB) == 1024
    # Almost nothing free: the floor (the pool the connector always had).
    assert default_staging_pages(131072, LAYOUT, 64 << 20) == DEFAULT_STAGING_PAGES


def test_sized_options_carry_the_new_pool_and_nothing_else() -> None:
    options = parse_connector_config({"host_pool_bytes": "1GiB"}, 16, env={})
    sized = with_staging_pages(options, 4096)
    assert sized.config.cache.device_pages == 4096
    assert sized.config.host == options.config.host
    assert sized.model_fingerprint == options.model_fingerprint


def test_saves_cross_the_bus_on_a_small_grid_unless_told_otherwise() -> None:
    from kvtier.integrations.vllm.options import DEFAULT_STORE_PROGRAMS

    assert parse_connector_config({}, 16, env={}).config.host.store_programs \
        == DEFAULT_STORE_PROGRAMS
    assert parse_connector_config({"store_programs": 0}, 16, env={}).config.host.store_programs \
        == 0
    env = {"KVTIER_HOST__STORE_PROGRAMS": "32"}
    assert parse_connector_config({}, 16, env=env).config.host.store_programs == 32


def test_the_prefetch_policy_is_a_connector_key_checked_like_the_config_field() -> None:
    assert parse_connector_config({}, 16, env={}).config.controller.prefetch_policy == "timeout"
    keyed = parse_connector_config({"prefetch_policy": "wait_complete"}, 16, env={})
    assert keyed.config.controller.prefetch_policy == "wait_complete"
    with pytest.raises(ConfigError, match="prefetch_policy"):
        parse_connector_config({"prefetch_policy": "forever"}, 16, env={})


def test_the_direct_path_is_taken_by_default_where_it_applies() -> None:
    """``"direct": "auto"`` (the default): the direct path on a CUDA device with one worker,
    kvtier's page one vLLM block and no staging pages asked for; the staged path otherwise."""
    auto = parse_connector_config(None, 16)
    assert auto.direct is None and auto.staging_from_default
    assert resolve_direct(auto, "cuda:0", ranked=False, block_size=16)
    assert not resolve_direct(auto, "cpu", ranked=False, block_size=16)
    assert not resolve_direct(auto, "cuda:0", ranked=True, block_size=16)
    pages = parse_connector_config({"page_size": 64}, 16)
    assert not resolve_direct(pages, "cuda:0", ranked=False, block_size=16)
    staged = parse_connector_config({"staging_pages": 512}, 16)
    assert not resolve_direct(staged, "cuda:0", ranked=False, block_size=16)
    assert not resolve_direct(parse_connector_config({"direct": False}, 16), "cuda:0", False, 16)
    assert resolve_direct(parse_connector_config({"direct": True}, 16), "cpu", False, 16)
    assert parse_connector_config({"direct": "auto"}, 16).direct is None


def test_the_decided_path_sets_the_device_pool() -> None:
    """Direct: the least device pool and no staging to size; staged: as parsed."""
    auto = parse_connector_config(None, 16)
    direct = with_direct(auto, True)
    assert direct.direct is True and not direct.staging_from_default
    assert direct.config.cache.device_pages == DIRECT_DEVICE_PAGES
    staged = with_direct(auto, False)
    assert staged.direct is False and staged.staging_from_default
    assert staged.config.cache.device_pages == DEFAULT_STAGING_PAGES
