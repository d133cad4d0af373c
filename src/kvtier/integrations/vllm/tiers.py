"""kvtier's disk and Redis stores as a secondary tier behind vLLM's own CPU offloading pool.

Owns ``KvtierSecondaryTier`` (a vLLM ``SecondaryTierManager``). vLLM's ``TieringOffloadingSpec``
keeps the CPU pool and moves blocks between it and the GPU; this tier moves whole pool chunks
between that pool and one kvtier store (``file://`` or ``redis://``, with kvtier's crash-safe
segments, verification, eviction, timeouts and breaker). Load it with::

    "kv_connector": "OffloadingConnector", "kv_connector_extra_config": {
      "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8000000000,
      "secondary_tiers": [{"type": "KvtierSecondaryTier",
                           "module_path": "kvtier.integrations.vllm.tiers",
                           "url": "file:///nvme/kvtier", "max_bytes": "500GiB"}]}

A chunk is stored as vLLM's pool lays it out (opaque bytes, not kvtier's canonical page), named
by a SHA-256 of a namespace (``namespace`` option, default the model and chunk size) and vLLM's
offload key, so two models or chunk sizes never share entries. ``lookup`` asks the store's
index; ``submit_store``/``submit_load`` queue the copy on the tier's IO threads and return at
once; ``get_finished_jobs`` reports completions. A failed or partial read is a failed job
(vLLM recomputes), never an exception on vLLM's scheduler thread, where every method runs.
"""

from __future__ import annotations

import hashlib
import logging
import queue
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.compat import require_offloading_plugins
from kvtier.store import open_store
from kvtier.units import parse_size

require_offloading_plugins()      # before the vLLM imports, which need its tiering API

# ruff: noqa: E402  (vLLM's imports follow the version check above)
from vllm.v1.kv_offload.base import LookupResult, Medium, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

log = logging.getLogger(__name__)


class KvtierSecondaryTier(SecondaryTierManager):
    """One kvtier store as a vLLM secondary tier."""

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, *, url: str = "", namespace: str = "",
                 max_bytes: int | str | None = None, io_threads: int = 2,
                 **store_options: Any) -> None:
        super().__init__(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view,
                         tier_type=tier_type, backpressure_detector=backpressure_detector)
        if not url:
            raise ConfigError("secondary_tiers[].url", url, "a kvtier store URL "
                              "(file:///path or redis://host:port/db)")
        if max_bytes is not None:
            store_options["max_bytes"] = _size(max_bytes)
        self.store = open_store(url, page_bytes=self.block_size_bytes, **store_options)
        if urlsplit(url).scheme == "file":
            self.medium, self.cache_hit_source = Medium.STORAGE, CacheHitSource.DISK
        self._rows = np.asarray(primary_kv_view).reshape(-1, self.block_size_bytes)
        self._seed = hashlib.sha256(b"kvtier-vllm-offload\0" + _namespace(
            offloading_spec, namespace, self.block_size_bytes).encode()).digest()
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvtier-tier")
        self._pending: set[Future] = set()
        self._done: queue.SimpleQueue[JobResult] = queue.SimpleQueue()

    def _key(self, key: bytes) -> bytes:
        return hashlib.sha256(self._seed + bytes(key)).digest()

    def _buffers(self, chunk_ids: Any) -> list[memoryview]:
        return [self._rows[int(c)].data for c in chunk_ids]

    # ---- lookups -------------------------------------------------------------------------
    def lookup(self, key: Any, req_context: Any) -> LookupResult:
        try:
            found = self.store.contains([self._key(key)])[0]
        except Exception:                     # an unreachable store holds nothing right now
            log.debug("kvtier tier lookup failed", exc_info=True)
            return LookupResult.MISS
        return LookupResult.HIT if found else LookupResult.MISS

    # ---- transfers -----------------------------------------------------------------------
    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self.store.write)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self.store.read_into)

    def _submit(self, job: TransferJob, move: Any) -> None:
        keys = list(job.keys)
        if len(keys) != len(job.chunk_ids):
            raise ValueError(f"job {job.job_id}: {len(keys)} keys for {len(job.chunk_ids)} chunks")
        future = self._pool.submit(self._run, job.job_id, keys, job.chunk_ids, move)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)

    def _run(self, job_id: Any, keys: list[Any], chunk_ids: Any, move: Any) -> None:
        try:
            ok = move([self._key(k) for k in keys], self._buffers(chunk_ids))
        except Exception:
            log.warning("kvtier tier job %s failed", job_id, exc_info=True)
            ok = [False] * len(keys)
        good = [k for k, fine in zip(keys, ok, strict=True) if fine]
        self._done.put(JobResult(job_id=job_id, success=len(good) == len(keys),
                                 successful_keys=good,
                                 transfer_bytes=len(good) * self.block_size_bytes))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def has_pending_work(self) -> bool:
        return bool(self._pending)

    def drain_jobs(self) -> None:
        wait(list(self._pending))

    # ---- requests and lifetime -----------------------------------------------------------
    def on_new_request(self, req_context: Any) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: Any) -> None:
        return

    def shutdown(self) -> None:
        self.drain_jobs()
        self._pool.shutdown(wait=True)
        self.store.close()


def _namespace(offloading_spec: Any, given: str, chunk_bytes: int) -> str:
    if given:
        return given
    config = getattr(offloading_spec, "vllm_config", None)
    model = getattr(getattr(config, "model_config", None), "model", "unknown-model")
    return f"{model}|{chunk_bytes}"


def _size(raw: int | str) -> int:
    value = raw if isinstance(raw, int) else parse_size(str(raw))
    if value is None or value < 1:
        raise ConfigError("secondary_tiers[].max_bytes", raw, "a byte count such as 500GiB")
    return value
