"""One wiring for building and for live changes, and the layering it keeps (admin above the
facade, benchmark tooling and CLI commands outside the runtime)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cache_support import LAYOUT, P, make_cache
from kvtier.admin.host_rebuild import rebuild_host_pool
from kvtier.admin.reconfig import StorageAdmin, Unsupported
from kvtier.config import build_config
from kvtier.controller.wiring import bind_store
from kvtier.errors import ConfigError
from kvtier.store.memory import MemoryStore

SRC = Path(__file__).resolve().parents[1] / "src" / "kvtier"
CONFIG = build_config(env={}, flags={"cache.page_size": P, "controller.io_workers": 2,
                                     "controller.min_prefetch_tokens": 0})
#: Layers above the admin layer: the only packages that may import ``kvtier.admin``.
ABOVE_ADMIN = ("admin", "serve", "commands", "cli.py", "__main__.py")


def _wiring(cache) -> tuple:  # type: ignore[no-untyped-def]
    ctx = cache.ctx
    return (ctx.host_pool.num_pages, ctx.copy.host_pool is ctx.host_pool,
            ctx.copy.device_pool is ctx.device_pool, ctx.workers.host_pool is ctx.host_pool,
            ctx.admission.capacity_pages, cache.controller.prefetcher.landing_cap,
            ctx.index.ledgers[1].allocator is ctx.host_pool.allocator)


def test_a_rebuilt_host_pool_is_wired_like_a_cache_built_with_that_pool() -> None:
    with make_cache(host_pages=24, stores={"disk": MemoryStore(LAYOUT.page_bytes)}) as fresh:
        want = _wiring(fresh)
    with make_cache(host_pages=64, stores={"disk": MemoryStore(LAYOUT.page_bytes)}) as cache:
        assert _wiring(cache) != want
        rebuild_host_pool(StorageAdmin(cache, CONFIG), pool_bytes=24 * LAYOUT.page_bytes)
        assert _wiring(cache) == want


def test_an_attached_store_starts_the_workers_a_build_with_it_would_have() -> None:
    with make_cache(stores={"disk": MemoryStore(LAYOUT.page_bytes)}) as built:
        want = _wiring(built)
    with make_cache() as cache:
        assert cache.ctx.workers is None and cache.ctx.admission is None
        StorageAdmin(cache, CONFIG).attach("disk", "memory://wiring-attach")
        assert _wiring(cache) == want


def test_binding_a_store_without_a_host_tier_is_refused_naming_the_tier() -> None:
    with make_cache(host_pages=0) as cache, pytest.raises(ConfigError, match="store.disk"):
        bind_store(cache.ctx, "disk", MemoryStore(LAYOUT.page_bytes), CONFIG)
    assert "disk" not in cache.ctx.stores


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
    return out


def test_no_layer_below_admin_imports_it_and_none_reaches_into_the_facade_privately() -> None:
    offenders = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        for module, names in _imports(path):
            if module.startswith("kvtier.admin") and not rel.startswith(ABOVE_ADMIN):
                offenders.append(f"{rel} imports {module}")
            if module == "kvtier.cache" and any(n.startswith("_") for n in names):
                offenders.append(f"{rel} imports private {names} from kvtier.cache")
    assert offenders == []


def test_the_runtime_imports_no_benchmark_tooling_and_no_cli_command() -> None:
    offenders = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        for module, _ in _imports(path):
            if module.startswith("kvtier.bench") and not rel.startswith(("bench/", "commands/")):
                offenders.append(f"{rel} imports {module}")
            if module.startswith("kvtier.commands") and not rel.startswith(("commands/", "cli.py")):
                offenders.append(f"{rel} imports {module}")
    assert offenders == []


def test_a_host_rebuild_without_a_pinned_budget_is_refused_and_changes_nothing() -> None:
    with make_cache(host_pages=16) as cache:
        admin = StorageAdmin(cache, CONFIG)
        pool, cache.pinned_budget = cache.ctx.host_pool, None
        with pytest.raises(Unsupported, match="pinned budget"):
            rebuild_host_pool(admin, pool_bytes=8 * LAYOUT.page_bytes)
        assert cache.ctx.host_pool is pool and not pool.closed
        admin.table.assert_coherent()


def test_the_facade_reads_its_host_pool_and_stores_and_refuses_an_unknown_store_tier() -> None:
    store = MemoryStore(LAYOUT.page_bytes)
    with make_cache(host_pages=16, stores={"disk": store}) as cache:
        assert cache.host_pool is not None and cache.host_pool.num_pages == 16
        assert cache.store("disk") is store and cache.store("remote") is None
        with pytest.raises(ValueError, match="disk, remote"):
            cache.store("host")
    with make_cache(host_pages=0) as cache:
        assert cache.host_pool is None and cache.store("disk") is None


def _reaches_inside(node: ast.AST, package: str) -> bool:
    """``<x>.tiered.ctx`` / ``<x>.cache.controller`` and the like; in ``serve/`` any ``.ctx``
    (the admin layer's context is the cache's too)."""
    if not isinstance(node, ast.Attribute):
        return False
    if package == "serve" and node.attr == "ctx":
        return True
    return (node.attr in ("ctx", "controller") and isinstance(node.value, ast.Attribute)
            and node.value.attr in ("tiered", "cache"))


def test_the_engine_plugins_and_server_use_the_facade_not_its_parts() -> None:
    """``TieredCache``'s ``ctx`` and ``controller`` are its internals: the reference engine,
    the plug-ins built on the facade and the server reach the cache through its public methods
    only."""
    reaching = []
    for package in ("engine", "integrations", "serve"):
        for path in sorted((SRC / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if _reaches_inside(node, package):
                    reaching.append(f"{path.relative_to(SRC)}:{node.lineno} .{node.attr}")
    assert not reaching, reaching
