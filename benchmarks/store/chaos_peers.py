"""The chaos suite's drivers of the peers' disk tiers (``chaos.py``), each through the peer's
own public storage API and key scheme (a chain hash of the page's tokens, placed by the peer's
own mapper): ``VllmFs``, vLLM's ``fs`` secondary tier (``FileMapper`` names,
``batch_store_block`` / ``batch_load_block``; a failed load is a miss, as its tier manager
treats it); ``SglangFile``, SGLang's ``HiCacheFile``; ``LmcacheDisk``, LMCache's
``LocalDiskBackend`` over a ``LocalCPUBackend`` allocator.

Each runs in its own ``--worker`` process under the Python that has the peer installed
(``--worker vllm-fs`` under vLLM's venv, and so on), and in the kill -9 ``--writer`` process,
on the main thread; ``LmcacheDisk`` also runs an asyncio loop on a daemon thread of its own for
LMCache's backend. The peer is imported inside the methods: every other Python imports this
module without it."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from chaos_driver import Adapter
from chaos_pages import LAYERS, Cfg, chain_hashes


class VllmFs(Adapter):
    name = "vllm-fs"
    index_files = ("*/config.json",)

    def mapper(self, root: Path, cfg: Cfg) -> Any:
        from vllm.v1.kv_offload.file_mapper import FileMapper

        groups = [{"tokens_per_block": cfg.page_tokens,
                   "layer_names": [f"model.layers.{n}.self_attn.attn" for n in range(LAYERS)]}]
        return FileMapper(str(root), cfg.model, cfg.page_tokens, 1, cfg.tp, 1, 1, 1, cfg.rank,
                          "torch." + cfg.dtype, kv_cache_groups=groups)

    def paths(self, root: Path, cfg: Cfg, idx: list[int]) -> list[str]:
        from vllm.v1.kv_offload.base import make_offload_key

        mapper = self.mapper(root, cfg)
        return [mapper.get_file_name(make_offload_key(h, 0)) for h in chain_hashes(cfg, idx)]

    def open(self, root: Path, cfg: Cfg) -> Any:
        mapper = self.mapper(root, cfg)
        path = Path(mapper.get_config_file_path())
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():  # as the tier manager does at start
            path.write_text(json.dumps(mapper.get_run_config()))
        return root

    def put(self, h: Any, cfg: Cfg, idx: list[int], pages: list[bytes]) -> list[bool]:
        from vllm.v1.kv_offload.tiering.fs.io import batch_store_block

        paths = self.paths(h, cfg, idx)
        buf = bytearray(b"".join(pages))
        try:
            batch_store_block(paths, memoryview(buf),
                              [n * cfg.page_bytes for n in range(len(idx))], cfg.page_bytes,
                              False)
        except OSError:  # the tier's pool catches a failed store job (refused)
            return [os.path.exists(p) for p in paths]
        return [True] * len(idx)

    def get(self, h: Any, cfg: Cfg, idx: list[int]) -> list[bytes | None]:
        from vllm.v1.kv_offload.tiering.fs.io import batch_load_block

        out: list[bytes | None] = []
        for path in self.paths(h, cfg, idx):
            if not os.path.exists(path):  # the tier's lookup
                out.append(None)
                continue
            buf = bytearray(cfg.page_bytes)
            try:
                batch_load_block([path], memoryview(buf), [0], cfg.page_bytes, False)
            except OSError:  # the tier's load job fails: its blocks are recomputed
                out.append(None)
                continue
            out.append(bytes(buf))
        return out

    def locate(self, root: Path, cfg: Cfg, i: int) -> tuple[Path, int, int]:
        return Path(self.paths(root, cfg, [i])[0]), 0, cfg.page_bytes


class SglangFile(Adapter):
    name = "sglang-file"

    def open(self, root: Path, cfg: Cfg) -> Any:
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

        config = HiCacheStorageConfig(
            tp_rank=cfg.rank, tp_size=cfg.tp, pp_rank=0, pp_size=1, attn_cp_rank=0,
            attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
            is_page_first_layout=True, model_name=cfg.model,
            extra_config={"file_storage_path": str(root)})
        return HiCacheFile(config, file_path=str(root))

    def put(self, h: Any, cfg: Cfg, idx: list[int], pages: list[bytes]) -> list[bool]:
        import torch

        return [bool(h.set(b.hex(), torch.frombuffer(bytearray(p), dtype=torch.uint8)))
                for b, p in zip(chain_hashes(cfg, idx), pages, strict=True)]

    def get(self, h: Any, cfg: Cfg, idx: list[int]) -> list[bytes | None]:
        import torch

        out: list[bytes | None] = []
        for b in chain_hashes(cfg, idx):
            if not h.exists(b.hex()):
                out.append(None)
                continue
            target = torch.zeros(cfg.page_bytes, dtype=torch.uint8)
            got = h.get(b.hex(), target)  # raises past FileNotFoundError
            out.append(None if got is None else bytes(target.numpy()))
        return out

    def locate(self, root: Path, cfg: Cfg, i: int) -> tuple[Path, int, int]:
        h = chain_hashes(cfg, [i])[0].hex()
        return root / f"{h}_{cfg.model}_{cfg.rank}_{cfg.tp}.bin", 0, cfg.page_bytes


class LmcacheDisk(Adapter):
    """LMCache's ``LocalDiskBackend`` over a ``LocalCPUBackend`` allocator, one chunk a page.
    Its index of what is on disk lives in the process (``dict``): a server that restarts
    starts empty, so ``open`` returns the live backend of a root to the same server (same
    config) and a new one to a new server."""

    name = "lmcache-disk"
    restart_forgets = True

    def __init__(self) -> None:
        import asyncio

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.live: dict[tuple[Any, ...], Any] = {}

    def open(self, root: Path, cfg: Cfg) -> Any:
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        ident = (str(root), cfg.model, cfg.tp, cfg.rank, cfg.dtype, cfg.page_tokens,
                 cfg.kv_heads, cfg.weights)
        if ident not in self.live:
            config = LMCacheEngineConfig.from_legacy(backend="local_disk")
            config.local_disk, config.max_local_disk_size, config.local_cpu = str(root), 1.0, False
            cpu = LocalCPUBackend(config, memory_allocator=AdHocMemoryAllocator("cpu"),
                                  dst_device="cpu")
            self.live[ident] = (LocalDiskBackend(config, self.loop, cpu, dst_device="cpu"), cpu)
        return self.live[ident]

    def close(self, h: Any) -> None:
        pass  # the server keeps running: its backend stays live

    def keys(self, cfg: Cfg, idx: list[int]) -> list[Any]:
        import torch
        from lmcache.utils import CacheEngineKey

        dtype = getattr(torch, cfg.dtype)
        return [CacheEngineKey(cfg.model, cfg.tp, cfg.rank, int.from_bytes(h[:8], "little"),
                               dtype) for h in chain_hashes(cfg, idx)]

    def put(self, h: Any, cfg: Cfg, idx: list[int], pages: list[bytes]) -> list[bool]:
        import torch
        from lmcache.v1.memory_management import MemoryFormat

        disk, cpu = h
        keys = self.keys(cfg, idx)
        for key, page in zip(keys, pages, strict=True):
            obj = cpu.allocate(torch.Size([len(page)]), torch.uint8, MemoryFormat.KV_2LTD)
            obj.tensor.copy_(torch.frombuffer(bytearray(page), dtype=torch.uint8))
            disk.submit_put_task(key, obj)
        deadline = time.monotonic() + 2.0  # writes are asynchronous: acknowledged once indexed
        while not all(disk.contains(k) for k in keys) and time.monotonic() < deadline:
            time.sleep(0.005)
        return [disk.contains(k) for k in keys]

    def get(self, h: Any, cfg: Cfg, idx: list[int]) -> list[bytes | None]:
        disk, _ = h
        out: list[bytes | None] = []
        for key in self.keys(cfg, idx):
            if not disk.contains(key):
                out.append(None)
                continue
            obj = disk.get_blocking(key)
            if obj is None:
                out.append(None)
                continue
            out.append(obj.tensor.numpy().tobytes()[:cfg.page_bytes])
            obj.ref_count_down()
        return out

    def locate(self, root: Path, cfg: Cfg, i: int) -> tuple[Path, int, int]:
        key = self.keys(cfg, [i])[0]
        return root / (key.to_string().replace("/", "-") + ".pt"), 0, cfg.page_bytes
