"""Chaos suite: every store driven through the same faults; per fault, pages served wrong,
refused, errors raised to the caller, and pages lost that should have survived.

Systems, each through its own public storage API, each in a subprocess under its own Python:

- ``kvtier-file``: kvtier's disk tier (``file://``) behind the ``StoreGuard`` a cache holds;
- ``kvtier-redis``: kvtier's Redis store (a real ``redis-server``, as the tests start it);
- ``vllm-fs``: vLLM's ``fs`` secondary tier (``FileMapper`` names, ``batch_store_block`` /
  ``batch_load_block`` move blocks; a failed load is a miss, as its tier manager treats it);
- ``sglang-file``: SGLang's ``HiCacheFile`` (``set`` / ``get`` / ``exists``);
- ``lmcache-disk``: LMCache's ``LocalDiskBackend`` when ``--lmcache-python`` names a Python
  with ``lmcache`` installed.

The model is small (2 layers, 2 KV heads of 32, pages of 16 tokens, bf16: 8 KiB a page) and
its KV is synthetic: page ``i``'s bytes are a pure function of (model, weights, dtype, shape,
page size, i), so a served page is checked exactly. Keys come from each system's own scheme
(kvtier: ``KeyNamespace`` with the checkpoint fingerprint of ``kvtier.model_identity``; the
peers: a chain hash of the page's tokens, placed by their own mappers).

Counts, per fault and system: ``wrong`` (served, bytes not the page asked for), ``refused``
(a miss), ``errors`` (an exception reached the caller of the API), ``lost`` (a page the fault did
not touch, or one acknowledged before a kill -9, that is no longer served). ``n/a``: the fault
has no meaning for the system (no index file, no Redis).

Run: ``python benchmarks/store/chaos.py --out benchmarks/results`` (as root: the full-disk and
read-only faults mount small tmpfs file systems; otherwise they are skipped and say so).
Writes ``chaos_cpu.json`` (with machine info) and prints the table. ``--worker SYSTEM`` runs one
system's faults in this process (what the parent runs under each venv).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import random
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from chaos_driver import Adapter, fresh, reopen_and_score, score
from chaos_pages import (
    BASE,
    FILE_FAULTS,
    HEAD_DIM,
    LAYERS,
    PAGES,
    REDIS_FAULTS,
    ROOT,
    TARGETS,
    Cfg,
    Count,
    chain_hashes,
    expected,
    isolated,
    older_format,
    page_tokens,
    patch,
    tmpfs,
)


class KvtierFile(Adapter):
    name = "kvtier-file"
    index_files = ("HEAD", "journal.*", "snapshot.*")
    manifest_files = ("kvtier-store.json",)

    def __init__(self, scratch: Path) -> None:
        from kvtier.model_identity import checkpoint_fingerprint

        # Two checkpoints of one name written into one directory, one after the other (a
        # fine-tune over its base): the fingerprint is taken from the files each time.
        ckpt = scratch / "checkpoint"
        self.fingerprints = {}
        for weights in ("base", "tuned"):
            tiny_checkpoint(ckpt, weights)
            self.fingerprints[weights] = checkpoint_fingerprint(ckpt)

    def keys(self, cfg: Cfg, idx: list[int]) -> list[bytes]:
        from kvtier.keys import KeyNamespace, page_keys

        ns = KeyNamespace(cfg.model, self.fingerprints[cfg.weights], cfg.dtype,
                          f"L{LAYERS}xK{cfg.kv_heads}xD{HEAD_DIM}", cfg.page_tokens)
        if isolated(cfg):
            return [bytes(page_keys(page_tokens(cfg, n), cfg.page_tokens, ns)[0]) for n in idx]
        chain = page_keys([t for n in range(max(idx) + 1) for t in page_tokens(cfg, n)],
                          cfg.page_tokens, ns)
        return [bytes(chain[n]) for n in idx]

    def open(self, root: Path, cfg: Cfg) -> Any:
        from kvtier.store import open_store
        from kvtier.store.guard import StoreGuard

        url = f"file://{root}"
        return StoreGuard.open("disk", lambda: open_store(url, page_bytes=cfg.full_page_bytes),
                               page_bytes=cfg.full_page_bytes, scheme="file", url=url)

    def put(self, h: Any, cfg: Cfg, idx: list[int], pages: list[bytes]) -> list[bool]:
        return list(h.write(self.keys(cfg, idx), [bytearray(p) for p in pages]))

    def get(self, h: Any, cfg: Cfg, idx: list[int]) -> list[bytes | None]:
        from kvtier.layout import ByteRange

        keys = self.keys(cfg, idx)
        bufs = [bytearray(cfg.page_bytes) for _ in idx]
        if cfg.tp == 1:
            ok = h.read_into(keys, bufs)
        else:  # a rank reads its heads of the layout-neutral page
            ranges = [ByteRange(o, n) for o, n in cfg.rank_ranges()]
            ok = h.read_ranges_into(keys, ranges, bufs)
        return [bytes(b) if hit else None for b, hit in zip(bufs, ok, strict=True)]

    def close(self, h: Any) -> None:
        h.close()

    def locate(self, root: Path, cfg: Cfg, i: int) -> tuple[Path, int, int]:
        key = self.keys(cfg, [i])[0]
        for seg in sorted((root / "segments").glob("*.seg")):
            data = seg.read_bytes()
            at = data.find(key)
            while at >= 0:
                head = at - 28
                if head >= 0 and data[head:head + 4] == b"KVTR":
                    (place,) = struct.unpack_from("<I", data, head + 8)
                    return seg, place * 512, cfg.full_page_bytes
                at = data.find(key, at + 1)
        raise LookupError(f"page {i} not found")

    def _header_at(self, root: Path, cfg: Cfg, i: int) -> tuple[Path, int]:
        key = self.keys(cfg, [i])[0]
        for seg in sorted((root / "segments").glob("*.seg")):
            data = seg.read_bytes()
            at = data.find(key)
            if at >= 28 and data[at - 28:at - 24] == b"KVTR":
                return seg, at - 28
        raise LookupError(f"page {i} not found")

    def rewrite_older_format(self, root: Path, cfg: Cfg, i: int, payload: bytes) -> None:
        import zlib

        from kvtier.store.record import payload_checksum

        seg, head = self._header_at(root, cfg, i)
        _, offset, _ = self.locate(root, cfg, i)
        old = seg.read_bytes()[head:head + 64]
        magic, _version, size, flags, length, _digest, key = struct.unpack("<4sHHIQQ32s", old[:60])
        body = struct.pack("<4sHHIQQ32s", magic, 0, size, flags, length,
                           payload_checksum(payload), key)
        patch(seg, head, body + struct.pack("<I", zlib.crc32(body)))
        patch(seg, offset, payload)

    def truncate(self, root: Path, cfg: Cfg, targets: tuple[int, ...]) -> set[int]:
        # One file holds many records: cut it in the middle of the first target's payload;
        # every record past the cut is damaged too.
        places = {i: self.locate(root, cfg, i) for i in range(PAGES)}
        seg, offset, length = places[targets[0]]
        cut = offset + length // 2
        os.truncate(seg, cut)
        return {i for i, (s, o, n) in places.items() if s == seg and o + n > cut}


class KvtierRedis(KvtierFile):
    name = "kvtier-redis"

    def __init__(self, scratch: Path, server: Any) -> None:
        super().__init__(scratch)
        self.server = server

    def open(self, root: Path, cfg: Cfg, query: str = "") -> Any:
        from kvtier.store import open_store
        from kvtier.store.guard import StoreGuard

        url = self.server.url(query=query or "timeout_s=0.5")
        return StoreGuard.open("remote", lambda: open_store(url, page_bytes=cfg.full_page_bytes),
                               page_bytes=cfg.full_page_bytes, scheme="redis", url=url)

    def rkey(self, cfg: Cfg, i: int) -> bytes:
        return b"kvtier:" + self.keys(cfg, [i])[0].hex().encode()


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


def tiny_checkpoint(directory: Path, weights: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                       "num_hidden_layers": LAYERS}))
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(weights.encode()).digest()[:4],
                                               "little"))
    data = rng.standard_normal(4096).astype(np.float32).tobytes()
    header = json.dumps({"w": {"dtype": "F32", "shape": [4096], "data_offsets": [0, len(data)]}})
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(header))
                                                  + header.encode() + data)


# ---- the faults ---------------------------------------------------------------------------


def fault_file(ad: Adapter, fault: str, root: Path, scratch: Path) -> Count:
    if fault == "kill9_mid_write":
        return _kill9(ad, root)
    if fault == "full_disk":
        return _full_disk(ad, scratch)
    if fault == "read_only_disk":
        return _read_only(ad, scratch)
    fresh(ad, root)
    damaged: set[int] = set(TARGETS)
    if fault == "bit_flip":
        for i in TARGETS:
            path, off, n = ad.locate(root, BASE, i)
            data = bytearray(path.read_bytes()[off + n // 3:off + n // 3 + 1])
            patch(path, off + n // 3, bytes([data[0] ^ 0x10]))
    elif fault == "zeroed_range":
        for i in TARGETS:
            path, off, _ = ad.locate(root, BASE, i)
            patch(path, off + 1024, bytes(512))
    elif fault == "truncated":
        damaged = ad.truncate(root, BASE, TARGETS)
    elif fault == "other_page_copied":
        for i in TARGETS:
            path, off, n = ad.locate(root, BASE, i)
            src, soff, _ = ad.locate(root, BASE, i + 1)
            with open(src, "rb") as f:
                f.seek(soff)
                payload = f.read(n)
            patch(path, off, payload)
    elif fault == "stale_older_format":
        for i in TARGETS:
            ad.rewrite_older_format(root, BASE, i, older_format(expected(BASE, i)))
    elif fault in ("deleted_index", "deleted_manifest"):
        patterns = ad.index_files if fault == "deleted_index" else ad.manifest_files
        if not patterns:
            return Count(note="n/a")
        for pattern in patterns:
            for path in root.glob(pattern):
                path.unlink()
        damaged = set()
    elif fault == "clock_skew":
        damaged = set()
        now = time.time()
        for n, path in enumerate(sorted(root.rglob("*"))):
            stamp = now + 10 * 365 * 86400 if n % 2 else 1.0  # ten years ahead, or 1970
            os.utime(path, (stamp, stamp))
        h = ad.open(root, BASE)  # and the store keeps working: new pages go in and come out
        more = replace(BASE, prompt=1)
        ok = ad.put(h, more, list(range(4)), [expected(more, i) for i in range(4)])
        c2 = score(ad, h, more, set(), idx=[i for i in range(4) if ok[i]])
        ad.close(h)
        c = reopen_and_score(ad, root, BASE, damaged)
        c.wrong += c2.wrong
        c.errors += c2.errors
        c.lost += c2.lost
        return c
    else:
        new = {"other_shape": replace(BASE, kv_heads=4),
               "other_page_size": replace(BASE, page_tokens=32),
               "other_dtype": replace(BASE, dtype="float8_e4m3fn"),
               "other_tp_size": replace(BASE, tp=2, rank=0),
               "fine_tune_same_name": replace(BASE, weights="tuned")}[fault]
        if fault == "other_tp_size" and not ad.restart_forgets:  # right for a TP 2 rank
            c = reopen_and_score(ad, root, new, set(), reusable=False)
            c.note = (c.note + " " if c.note else "") + f"{PAGES - c.refused} served"
            return c
        c = reopen_and_score(ad, root, new, set(range(PAGES)), reusable=False)
        if ad.restart_forgets:
            c.note = "a new server's index starts empty: nothing on disk is found"
        return c
    return reopen_and_score(ad, root, BASE, damaged)


def _kill9(ad: Adapter, root: Path, rounds: int = 4) -> Count:
    total = Count()
    acked: set[int] = set()
    tried: set[int] = set()
    rng = random.Random(11)
    for r in range(rounds):
        start = r * 1000
        proc = subprocess.Popen([sys.executable, __file__, "--writer", ad.name, "--root",
                                 str(root), "--start", str(start)],
                                stdout=subprocess.PIPE, text=True, env=os.environ.copy())
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == "open\n", line
        time.sleep(rng.uniform(0.05, 0.3))
        os.kill(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        lines = [ln for ln in out.splitlines(keepends=True) if ln.endswith("\n")]
        acked |= {int(x) for ln in lines for x in ln.split()}
        tried |= set(range(start, max(acked | {start}) + 8))
    cfg = replace(BASE, prompt=-1)
    h = ad.open(root, cfg)
    order = sorted(tried)
    for at in range(0, len(order), 64):
        chunk = order[at:at + 64]
        got = ad.get(h, cfg, chunk)
        for i, page in zip(chunk, got, strict=True):
            if page is None:
                if i in acked:
                    total.lost += 1
            elif page != expected(cfg, i):
                total.wrong += 1
    ad.close(h)
    total.note = f"{len(acked)} acknowledged over {rounds} kills"
    return total


def writer_main(system: str, root: Path, start: int) -> None:
    """Write pages in batches forever, printing the acknowledged ones (killed by the parent)."""
    scratch = root.parent / f"writer-{start}"
    scratch.mkdir(exist_ok=True)
    ad = adapter(system, scratch)
    cfg = replace(BASE, prompt=-1)
    h = ad.open(root, cfg)
    print("open", flush=True)
    i = start
    while True:
        idx = list(range(i, i + 4))
        ok = ad.put(h, cfg, idx, [expected(cfg, n) for n in idx])
        print(" ".join(str(n) for n, a in zip(idx, ok, strict=True) if a), flush=True)
        i += 4


def _full_disk(ad: Adapter, scratch: Path) -> Count:
    if os.geteuid() != 0:
        return Count(note="skipped: mounting a small tmpfs needs root")
    c = Count()
    with tmpfs(scratch, "256k") as root:
        h = ad.open(root, BASE)
        acked: set[int] = set()
        for i in range(PAGES):  # 24 pages of 8 KiB + metadata into 256 KiB ... then past it
            try:
                ok = ad.put(h, BASE, [i], [expected(BASE, i)])
            except Exception as exc:
                c.errors += 1
                c.note = f"write: {type(exc).__name__}"
                continue
            if ok[0]:
                acked.add(i)
        filler = root / "filler"
        with contextlib.suppress(OSError), open(filler, "wb") as f:
            f.write(bytes(1 << 20))  # whatever room is left, taken by another program
        more = replace(BASE, prompt=2)
        try:
            ok = ad.put(h, more, list(range(4)), [expected(more, n) for n in range(4)])
            refused_writes = ok.count(False)
        except Exception as exc:
            c.errors += 1
            c.note = f"write when full: {type(exc).__name__}"
            refused_writes = 4
        ad.close(h)
        got = reopen_and_score(ad, root, BASE, set(range(PAGES)) - acked)
        c.wrong, c.lost = got.wrong, got.lost
        c.errors += got.errors
        c.refused = got.refused
        c.note = (c.note + "; " if c.note else "") + (
            f"{len(acked)} of {PAGES} acknowledged; {refused_writes}/4 writes refused when full")
    return c


def _read_only(ad: Adapter, scratch: Path) -> Count:
    if os.geteuid() != 0:
        return Count(note="skipped: remounting read-only needs root")
    with tmpfs(scratch, "16m") as root:
        fresh(ad, root)
        subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
        c = reopen_and_score(ad, root, BASE, set())
        try:
            h = ad.open(root, BASE)
            more = replace(BASE, prompt=3)
            ok = ad.put(h, more, list(range(4)), [expected(more, n) for n in range(4)])
            c.note = f"{ok.count(False)}/4 new writes refused"
            ad.close(h)
        except Exception as exc:
            c.errors += 1
            c.note = f"write: {type(exc).__name__}: {exc}"[:160]
    return c


# ---- Redis faults (kvtier's Redis store) ----------------------------------------------------
def fault_redis(ad: KvtierRedis, fault: str) -> Count:
    server = ad.server
    client = server.client()
    client.flushall()
    h = ad.open(Path("."), BASE)
    assert all(ad.put(h, BASE, list(range(PAGES)), [expected(BASE, i) for i in range(PAGES)]))
    damaged: set[int] = set(TARGETS)
    reusable = True
    try:
        if fault == "bit_flip":
            for i in TARGETS:
                k = ad.rkey(BASE, i)
                value = bytearray(client.get(k))
                value[64 + 1000] ^= 0x10
                client.set(k, bytes(value))
        elif fault == "zeroed_range":
            for i in TARGETS:
                client.setrange(ad.rkey(BASE, i), 64 + 1024, bytes(512))
        elif fault == "truncated":
            for i in TARGETS:
                k = ad.rkey(BASE, i)
                value = client.get(k)
                client.set(k, value[:len(value) // 2])
        elif fault == "other_page_copied":  # the other page's payload under this header
            for i in TARGETS:
                k = ad.rkey(BASE, i)
                own, other = client.get(k), client.get(ad.rkey(BASE, i + 1))
                client.set(k, own[:64] + other[64:])
        elif fault == "stale_older_format":
            import zlib

            from kvtier.store.record import payload_checksum

            for i in TARGETS:
                k = ad.rkey(BASE, i)
                value = client.get(k)
                payload = older_format(expected(BASE, i))
                f = list(struct.unpack("<4sHHIQQ32s", value[:60]))
                f[1], f[5] = 0, payload_checksum(payload)
                body = struct.pack("<4sHHIQQ32s", *f)
                client.set(k, body + struct.pack("<I", zlib.crc32(body)) + payload)
        elif fault == "tenant_overwrite":
            # Another tenant (another model on the same server) writes its record for its own
            # page under this tenant's key (a shared prefix setting, a bug, a restore).
            other = replace(BASE, model="tenant-b")
            h2 = ad.open(Path("."), other, query="timeout_s=0.5&prefix=tenant-b:")
            ad.put(h2, other, list(TARGETS), [expected(other, i) for i in TARGETS])
            h2.close()
            for i in TARGETS:
                value = client.get(b"tenant-b:" + ad.keys(other, [i])[0].hex().encode())
                client.set(ad.rkey(BASE, i), value)
        elif fault == "evicted_mid_read":
            return _redis_evicted(ad, h, client)
        elif fault == "restarted_empty":
            server.restart()
            damaged, reusable = set(range(PAGES)), False
        elif fault == "slow_server":
            return _redis_slow(ad, h, client)
        elif fault == "connection_dropped":
            return _redis_dropped(ad, h, client)
        return score(ad, h, BASE, damaged, reusable=reusable)
    finally:
        h.close()
        client.close()


def _redis_evicted(ad: KvtierRedis, h: Any, client: Any) -> Count:
    c = Count()
    stop = threading.Event()

    def pressure() -> None:
        filler = bytes(64 << 10)
        n = 0
        while not stop.is_set():
            client.set(f"filler:{n}".encode(), filler)
            n += 1

    client.config_set("maxmemory-policy", "allkeys-lru")
    client.config_set("maxmemory", str(int(client.info("memory")["used_memory"]) + (256 << 10)))
    thread = threading.Thread(target=pressure, daemon=True)
    thread.start()
    try:
        for _ in range(30):
            got = score(ad, h, BASE, set(range(PAGES)), reusable=False)
            c.wrong += got.wrong
            c.refused += got.refused
            c.errors += got.errors
    finally:
        stop.set()
        thread.join()
        client.config_set("maxmemory", "0")
    c.note = f"30 reads of {PAGES} pages while another writer fills memory"
    return c


def _redis_slow(ad: KvtierRedis, h: Any, client: Any) -> Count:
    c = Count()
    worst = 0.0
    for pause_ms in (100, 1000, 5000):
        admin = ad.server.client()
        admin.execute_command("CLIENT", "PAUSE", pause_ms, "ALL")
        t0 = time.monotonic()
        got = score(ad, h, BASE, set(range(PAGES)), reusable=False)
        worst = max(worst, time.monotonic() - t0)
        c.wrong += got.wrong
        c.refused += got.refused
        c.errors += got.errors
        admin.execute_command("CLIENT", "UNPAUSE")
        admin.close()
        after = score(ad, h, BASE, set(), reusable=True)  # served again once it answers
        deadline = time.monotonic() + 10
        while after.lost and time.monotonic() < deadline:
            time.sleep(0.2)
            after = score(ad, h, BASE, set(), reusable=True)
        c.wrong += after.wrong
        c.lost += after.lost
    c.note = f"pauses 0.1/1/5 s; slowest read call {worst:.2f} s (deadline 0.5 s)"
    return c


def _redis_dropped(ad: KvtierRedis, h: Any, client: Any) -> Count:
    c = Count()
    stop = threading.Event()

    def killer() -> None:
        admin = ad.server.client()
        while not stop.is_set():
            with contextlib.suppress(Exception):
                admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
            time.sleep(0.003)
        admin.close()

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        for _ in range(40):
            got = score(ad, h, BASE, set(range(PAGES)), reusable=False)
            c.wrong += got.wrong
            c.refused += got.refused
            c.errors += got.errors
    finally:
        stop.set()
        thread.join()
    c.note = f"40 reads of {PAGES} pages while connections are killed every 3 ms"
    return c


# ---- kvtier's server end to end (the engine a ``kvtier serve`` runs, embedded tiny model) ----
SERVE_FAULTS = ("bit_flip", "zeroed_range", "truncated", "other_page_copied",
                "stale_older_format", "deleted_index", "fine_tune_same_name", "clock_skew",
                "read_only_disk")


def _records(root: Path) -> list[tuple[Path, int, int, int]]:
    """Every record of a kvtier disk store: (segment, header offset, payload offset, length)."""
    import zlib

    out = []
    for seg in sorted((root / "segments").glob("*.seg")):
        data = seg.read_bytes()
        at = data.find(b"KVTR")
        while at >= 0:
            head = data[at:at + 64]
            if len(head) == 64 and zlib.crc32(head[:60]) == struct.unpack("<I", head[60:])[0]:
                _, _, _, place, length, _, _ = struct.unpack("<4sHHIQQ32s", head[:60])
                out.append((seg, at, place * 512, length))
            at = data.find(b"KVTR", at + 1)
    return out


def _damage_store(fault: str, root: Path) -> None:
    import zlib

    records = _records(root)
    for n, (seg, head, off, length) in enumerate(records):
        if fault == "bit_flip":
            with open(seg, "r+b") as f:
                f.seek(off + length // 3)
                byte = f.read(1)[0]
                f.seek(off + length // 3)
                f.write(bytes([byte ^ 0x10]))
        elif fault == "zeroed_range":
            patch(seg, off + length // 4, bytes(min(512, length // 2)))
        elif fault == "other_page_copied" and len(records) > 1:
            src, _, soff, _ = records[(n + 1) % len(records)]
            with open(src, "rb") as f:
                f.seek(soff)
                patch(seg, off, f.read(length))
        elif fault == "stale_older_format":
            body = bytearray(seg.read_bytes()[head:head + 60])
            body[4:6] = struct.pack("<H", 0)
            patch(seg, head, bytes(body) + struct.pack("<I", zlib.crc32(bytes(body))))
    if fault == "truncated":
        for seg in sorted((root / "segments").glob("*.seg")):
            os.truncate(seg, seg.stat().st_size // 2)
    elif fault == "deleted_index":
        for pattern in KvtierFile.index_files:
            for path in root.glob(pattern):
                path.unlink()
    elif fault == "clock_skew":
        for n, path in enumerate(sorted(root.rglob("*"))):
            stamp = time.time() + 10 * 365 * 86400 if n % 2 else 1.0
            os.utime(path, (stamp, stamp))


def _serve_prompts() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(5, 1000) for _ in range(320)]
    return [shared[:rng.randrange(200, 320)] + [rng.randrange(5, 1000) for _ in range(40)]
            for _ in range(6)]


def _service(disk: Path | None, seed: int, cache: bool = True) -> Any:
    from kvtier.config import build_config
    from kvtier.engine.service import EngineService

    flags = {"engine.model": "tiny-llama", "engine.device": "cpu", "engine.dtype": "float32",
             "engine.seed": str(seed), "cache.enabled": str(cache).lower(),
             "cache.page_size": "16", "host.pool_bytes": "8MiB" if cache else "0",
             "controller.min_prefetch_tokens": "0",
             "controller.prefetch_policy": "wait_complete",
             "store.disk_url": f"file://{disk}" if disk else ""}
    return EngineService.build(build_config(env={}, flags=flags), max_running=1)


def _answers(service: Any, batch: list[list[int]]) -> tuple[list[list[int]], int]:
    from kvtier.engine.request import GenerationRequest

    out, disk_tokens = [], 0
    for prompt in batch:
        tokens, finish = service.submit(GenerationRequest(tuple(prompt), 12)).result(timeout=600)
        out.append(list(tokens))
        disk_tokens += finish.prefill.cached_by_tier.get("disk", 0)
    return out, disk_tokens


def run_server_faults(faults: tuple[str, ...] = SERVE_FAULTS) -> dict[str, Any]:
    """Per fault: a server with a disk tier answers the prompts and stops (its writes
    flushed); the fault hits its disk directory; a restarted server answers them again.
    ``wrong``: answers unlike ``--no-cache``'s; ``refused``: prompts that got no disk hit."""
    prompts_ = _serve_prompts()
    wants = {}
    for seed in (0, 1):
        plain = _service(None, seed, cache=False)
        try:
            wants[seed] = _answers(plain, prompts_)[0]
        finally:
            plain.close()
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fault in ("none", *faults):
            if fault == "read_only_disk" and os.geteuid() != 0:
                out[fault] = Count(note="skipped: remounting read-only needs root").as_dict()
                continue
            with contextlib.ExitStack() as stack:
                root = (stack.enter_context(tmpfs(Path(tmp), "4g")) if fault ==
                        "read_only_disk" else Path(tmp) / fault) / "disk"
                first = _service(root, 0)
                try:
                    _answers(first, prompts_)
                finally:
                    first.close()
                if fault == "read_only_disk":
                    subprocess.run(["mount", "-o", "remount,ro", str(root.parent)], check=True)
                else:
                    _damage_store(fault, root)
                seed = 1 if fault == "fine_tune_same_name" else 0
                c = Count()
                try:
                    again = _service(root, seed)
                    try:
                        got, disk_tokens = _answers(again, prompts_)
                    finally:
                        again.close()
                    c.wrong = sum(a != b for a, b in zip(got, wants[seed], strict=True))
                    c.note = f"{disk_tokens} prompt tokens served from disk"
                except Exception as exc:  # an error reached the client
                    c.errors = 1
                    c.note = f"{type(exc).__name__}: {exc}"[:160]
                out[fault] = c.as_dict()
    return out


# ---- workers and the parent ----------------------------------------------------------------
def adapter(system: str, scratch: Path, server: Any = None) -> Adapter:
    if system == "kvtier-file":
        return KvtierFile(scratch)
    if system == "kvtier-redis":
        return KvtierRedis(scratch, server)
    if system == "vllm-fs":
        return VllmFs()
    if system == "sglang-file":
        return SglangFile()
    if system == "lmcache-disk":
        return LmcacheDisk()
    raise SystemExit(f"unknown system {system}")


def run_file_faults(system: str, faults: tuple[str, ...] = FILE_FAULTS) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        ad = adapter(system, scratch)
        for fault in faults:
            root = scratch / fault
            root.mkdir()
            try:
                out[fault] = fault_file(ad, fault, root, scratch).as_dict()
            except Exception as exc:
                out[fault] = Count(errors=-1, note=f"harness: {type(exc).__name__}: {exc}"
                                   ).as_dict()
    return out


def run_redis_faults(faults: tuple[str, ...] = REDIS_FAULTS) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "tests"))
    from redis_server import REDIS_SERVER, RedisServer

    if REDIS_SERVER is None:
        return {f: Count(note="skipped: no redis-server").as_dict() for f in faults}
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "redis").start()
        try:
            ad = KvtierRedis(Path(tmp), server)
            for fault in faults:
                out[fault] = fault_redis(ad, fault).as_dict()
        finally:
            server.stop()
    return out


def worker_main(system: str) -> None:
    logging_quiet()
    if system == "kvtier-redis":
        result = run_redis_faults()
    elif system == "kvtier-serve":
        result = run_server_faults()
    else:
        result = run_file_faults(system)
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # peers leave non-daemon threads (IO pools) behind


def logging_quiet() -> None:
    import logging

    logging.disable(logging.CRITICAL)


SYSTEMS = {
    "kvtier-file": ("/work/main/.venv/bin/python", True),
    "kvtier-redis": ("/work/main/.venv/bin/python", True),
    "kvtier-serve": ("/work/main/.venv/bin/python", True),
    "vllm-fs": ("/work/main/.venv-vllm/bin/python", False),
    "sglang-file": ("/work/main/.venv-sglang/bin/python", False),
}


def run_system(system: str, python: str, with_src: bool, timeout: float = 900) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if with_src:
        env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.run([python, __file__, "--worker", system], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"_failed": f"rc={proc.returncode}: {proc.stderr[-1500:]}"}


def render(results: dict[str, dict[str, Any]]) -> str:
    systems = [s for s in results if s != "kvtier-serve"]
    faults = [*FILE_FAULTS, *(f"redis:{f}" for f in REDIS_FAULTS)]
    head = f"{'fault':26}" + "".join(f"{s:>15}" for s in systems)
    lines = [head, "-" * len(head)]
    for fault in faults:
        cells = []
        for s in systems:
            redis_row = fault.startswith("redis:")
            r = results[s].get(fault.removeprefix("redis:"))
            if (s == "kvtier-redis") != redis_row:
                cells.append("n/a")
            elif "_failed" in results[s]:
                cells.append("failed")
            elif r is None:
                cells.append("-")
            elif r.get("note", "").startswith(("n/a", "skipped")):
                cells.append(r["note"].split(":")[0])
            else:
                cells.append(f"{r['wrong']}/{r['refused']}/{r['lost']}"
                             + (f" E{r['errors']}" if r["errors"] else ""))
        lines.append(f"{fault:26}" + "".join(f"{c:>15}" for c in cells))
    lines.append("cells: pages served wrong / refused (a miss) / lost (untouched by the fault, or "
                 "acknowledged before a kill -9, and not served); E<n>: exceptions that reached "
                 "the caller")
    serve = results.get("kvtier-serve")
    if serve and "_failed" not in serve:
        lines += ["", "kvtier serve (embedded tiny-llama, CPU), restarted on the damaged disk "
                  "directory: wrong answers against --no-cache",
                  f"{'fault':26}{'wrong answers':>15}{'errors':>8}  disk tokens served"]
        for fault, r in serve.items():
            lines.append(f"{fault:26}{r['wrong']:>15}{r['errors']:>8}  {r['note']}")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "processor": platform.processor(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker")
    parser.add_argument("--writer")
    parser.add_argument("--root")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--systems", default=",".join([*SYSTEMS, "lmcache-disk"]))
    parser.add_argument("--lmcache-python", default="")
    args = parser.parse_args()
    if args.writer:
        writer_main(args.writer, Path(args.root), args.start)
        return
    if args.worker:
        worker_main(args.worker)
        return
    results: dict[str, dict[str, Any]] = {}
    if args.lmcache_python:
        SYSTEMS["lmcache-disk"] = (args.lmcache_python, False)
    for system in args.systems.split(","):
        if system not in SYSTEMS:
            results[system] = {"_failed": "no Python with it installed (--lmcache-python)"}
            continue
        python, with_src = SYSTEMS[system]
        t0 = time.monotonic()
        results[system] = run_system(system, python, with_src)
        print(f"{system}: {time.monotonic() - t0:.1f} s", file=sys.stderr)
    table = render(results)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "chaos_cpu.json").write_text(json.dumps(
            {"machine": machine(), "pages": PAGES, "targets": TARGETS, "results": results},
            indent=1) + "\n")


if __name__ == "__main__":
    main()
