"""kvtier's stores as an SGLang HiCache storage backend (``--hicache-storage-backend dynamic``).

Owns ``KvtierHiCacheStorage``, a subclass of SGLang 0.5.23's ``HiCacheStorage``. SGLang builds it
with ``(storage_config, kwargs)`` and then registers its host pool; the stores open then, since
the page size comes from the pool. Launch (see README, "SGLang")::

    python -m sglang.launch_server --model-path M --enable-hierarchical-cache \\
      --hicache-mem-layout page_first_direct --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang", "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1, "kvtier": {"disk_url": "file:///nvme/kvtier"}}'

With ``interface_v1`` SGLang calls ``batch_get_v1``/``batch_set_v1``, and pages move between the
host pool and the stores without SGLang's per-page temporary tensors (directly from the pool's
memory where a stored page is contiguous there); without it, the generic ``batch_get``/
``batch_set`` over flat pages. ``exists``/``batch_exists`` ask the stores' indexes, never page
data. A missing, corrupt or unreachable page is a miss (``False``/``None``/a shorter prefix),
never an exception: SGLang's prefetch and backup threads must not die on one bad page. Keys,
rank handling and the MLA single writer: ``keys``; pool layouts: ``pages``.

Called from SGLang's scheduler thread (construction, registration, close) and its prefetch and
backup threads (everything else, concurrently).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageExtraInfo

from kvtier.integrations.sglang.keys import (
    KeyMapper,
    ShardIdentity,
    default_fingerprint,
    shard_identity,
)
from kvtier.integrations.sglang.mover import PageMover
from kvtier.integrations.sglang.options import SGLangBackendOptions, parse_extra_config
from kvtier.integrations.sglang.pages import PoolPages, describe_pool, dtype_name
from kvtier.integrations.sglang.tiers import TierChain, open_tiers

log = logging.getLogger(__name__)


class KvtierHiCacheStorage(HiCacheStorage):
    """SGLang HiCache storage over kvtier's disk (``file://``) and remote (``redis://``) tiers."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.options: SGLangBackendOptions = parse_extra_config(storage_config.extra_config)
        self.pages: PoolPages | None = None
        self.identity: ShardIdentity | None = None
        self.tiers: TierChain | None = None
        self._keys: KeyMapper | None = None
        self._mover: PageMover | None = None
        self._metrics = _OpMetrics()

    # ---- set-up ------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pages = describe_pool(mem_pool_host)
        identity = shard_identity(
            self.storage_config, page_format=pages.page_format, dtype=dtype_name(pages.dtype),
            page_size=pages.page_size, local_heads=pages.local_heads, layers=pages.layer_range,
            model_fingerprint=self.options.model_fingerprint
            or default_fingerprint(self.storage_config.model_name),
            heads_total=self.options.kv_heads_total)
        subdir = pages.page_format.replace(":", "_") if self.options.layout_subdir else None
        tiers = open_tiers(self.options.store_urls, pages.page_bytes, subdir=subdir,
                           options=_tier_options(self.options), promote=self.options.promote)
        if self.tiers is not None:
            self.tiers.close()
        self.pages, self.identity, self.tiers = pages, identity, tiers
        self._keys = KeyMapper(identity)
        self._mover = PageMover(pages, tiers, self.options.staging_bytes)
        log.info("kvtier HiCache backend: %s pages of %d bytes (%s), shard %s, writer=%s",
                 pages.kind, pages.page_bytes, "direct" if pages.direct else "staged",
                 identity.descriptor(), identity.writer)

    def describe(self) -> dict[str, Any]:
        """What this backend stores and where (for logs, tests and the README's examples)."""
        pages, identity = self.pages, self.identity
        return {
            "kind": pages.kind if pages else None,
            "page_bytes": pages.page_bytes if pages else None,
            "direct": pages.direct if pages else None,
            "shard": identity.descriptor() if identity else None,
            "writer": identity.writer if identity else None,
            "tiers": [name for name, _ in self.tiers.tiers] if self.tiers else [],
        }

    # ---- presence ----------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        if not keys or not self._ready("batch_exists"):
            return 0
        present = self.tiers.contains(self._keys.keys(keys))
        return present.index(False) if False in present else len(present)

    # ---- zero-copy API -----------------------------------------------------------------
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        starts = self._page_starts(keys, host_indices, "batch_get_v1")
        if starts is None:
            return [False] * len(keys)
        return self._timed("get", len(keys), lambda: self._mover.load(self._keys.keys(keys), starts))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if self.identity is not None and not self.identity.writer:
            return [True] * len(keys)  # another rank stores these bytes under the same keys
        starts = self._page_starts(keys, host_indices, "batch_set_v1")
        if starts is None:
            return [False] * len(keys)
        return self._timed("set", len(keys), lambda: self._mover.save(self._keys.keys(keys), starts))

    # ---- generic API -------------------------------------------------------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        if not keys or not self._ready("batch_get"):
            return [None] * len(keys)
        flats = list(target_locations) if target_locations is not None else [
            self.pages.pool.get_dummy_flat_data_page() for _ in keys]
        if len(flats) != len(keys) or not all(self._fits(f) for f in flats):
            log.error("kvtier batch_get: %d keys but targets of the wrong count or size", len(keys))
            return [None] * len(keys)
        found = self._timed("get", len(keys), lambda: self._mover.load_flat(self._keys.keys(keys), flats))
        return [flat if ok else None for ok, flat in zip(found, flats, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if not keys:
            return True
        if self.identity is not None and not self.identity.writer:
            return True
        if not self._ready("batch_set"):
            return False
        values = list(values or [])
        if len(values) != len(keys) or not all(self._fits(v) for v in values):
            log.error("kvtier batch_set: %d keys but values of the wrong count or size", len(keys))
            return False
        stored = self._timed("set", len(keys), lambda: self._mover.save_flat(self._keys.keys(keys), values))
        return all(stored)

    # ---- housekeeping ------------------------------------------------------------------
    def clear(self) -> None:
        """SGLang's cache flush: kvtier's tiers are shared and persistent, so they are kept.

        Wiping a disk or Redis tier that other servers read is an administrative act; use
        ``kvtier store`` tools or the store's own eviction caps instead.
        """
        log.info("kvtier HiCache backend: flush requested; persistent tiers are left intact")

    def get_stats(self) -> Any:
        return self._metrics.drain()

    def stats(self) -> dict[str, Any]:
        """kvtier's view: per-tier store stats plus the backend's own counters."""
        tiers = self.tiers.stats() if self.tiers else {}
        return {"tiers": tiers, "backend": self._metrics.totals(),
                "chain_errors": self.tiers.counters.snapshot()["errors"] if self.tiers else 0}

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.close()

    # ---- helpers -----------------------------------------------------------------------
    def _ready(self, op: str) -> bool:
        if self._mover is None:
            log.error("kvtier %s before register_mem_pool_host: answered as a miss", op)
            return False
        return True

    def _page_starts(self, keys: list[str], host_indices: torch.Tensor, op: str) -> list[int] | None:
        if not keys or not self._ready(op):
            return None
        count = int(host_indices.numel())
        if count == 0 or count % len(keys):
            log.error("kvtier %s: %d keys but %d host slots", op, len(keys), count)
            return None
        return host_indices[:: count // len(keys)].tolist()

    def _fits(self, tensor: Any) -> bool:
        return (isinstance(tensor, torch.Tensor) and tensor.is_contiguous()
                and tensor.numel() * tensor.element_size() == self.pages.page_bytes)

    def _timed(self, op: str, count: int, run: Any) -> list[bool]:
        start = time.perf_counter()
        try:
            done = run()
        except Exception:  # never let one bad page kill SGLang's storage threads
            log.exception("kvtier HiCache %s of %d pages failed; answered as misses", op, count)
            self._metrics.error()
            return [False] * count
        pages = sum(done)
        self._metrics.record(op, pages, pages * self.pages.page_bytes, time.perf_counter() - start)
        return done


class _OpMetrics:
    """Pages and bandwidth per get/set call since the last drain, for SGLang's storage metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, list[tuple[int, float]]] = {"get": [], "set": []}
        self._totals = {"get_pages": 0, "set_pages": 0, "get_bytes": 0, "set_bytes": 0, "errors": 0}

    def record(self, op: str, pages: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._pending[op].append((pages, nbytes / 1e9 / max(seconds, 1e-9)))
            self._totals[f"{op}_pages"] += pages
            self._totals[f"{op}_bytes"] += nbytes

    def error(self) -> None:
        with self._lock:
            self._totals["errors"] += 1

    def totals(self) -> dict[str, int]:
        with self._lock:
            return dict(self._totals)

    def drain(self) -> Any:
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return None
        with self._lock:
            gets, sets = self._pending["get"], self._pending["set"]
            self._pending = {"get": [], "set": []}
        return StorageMetrics(prefetch_pgs=[p for p, _ in gets], backup_pgs=[p for p, _ in sets],
                              prefetch_bandwidth=[b for _, b in gets],
                              backup_bandwidth=[b for _, b in sets])


def _tier_options(options: SGLangBackendOptions) -> dict[str, dict[str, Any]]:
    """kvtier's store settings as store options, unless a URL's query sets them itself."""
    store = options.store
    out: dict[str, dict[str, Any]] = {}
    for tier, url in options.store_urls.items():
        scheme = urlsplit(url).scheme
        wanted: dict[str, Any] = {}
        if scheme == "file":
            wanted = {"max_bytes": store.disk_max_bytes, "min_free_bytes": store.disk_min_free_bytes}
        elif scheme == "memory" and tier == "disk":
            wanted = {"max_bytes": store.disk_max_bytes}
        elif scheme in ("redis", "rediss"):
            wanted = {"timeout_s": store.remote_timeout_s}
            if store.remote_ttl_s:
                wanted["ttl_s"] = store.remote_ttl_s
        given = {name for name, _ in parse_qsl(urlsplit(url).query)}
        out[tier] = {k: v for k, v in wanted.items() if k not in given}
    return out
