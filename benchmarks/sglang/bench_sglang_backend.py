"""kvtier's SGLang storage backend beside SGLang's own ``HiCacheFile``, on the same host pool pages.

Runs inside ``.venv-sglang`` (``bash scripts/setup_sglang_env.sh``). For each page shape it fills
a real SGLang host pool with random KV, then, per contestant, stores the pages in SGLang's batches
of 128 and reads them back into other pool slots, through the code SGLang itself runs: the cache
controller's ``_generic_page_set/_get`` (how SGLang drives ``HiCacheFile``) and
``_page_set_zero_copy/_get_zero_copy`` (``interface_v1``, how it drives kvtier). Contestants:

- ``sglang-file``: SGLang's HiCacheFile (one file per page), default settings;
- ``kvtier-v1``: kvtier's backend over ``file://`` with ``interface_v1`` (writes into the pool);
- ``kvtier-generic``: kvtier's backend over ``file://`` without it (SGLang's flat pages);
- ``raw-file``: the ceiling, bytes only: one file, one ``pwrite``/``preadv`` per page into an
  aligned buffer, no pool copy, no verification.

Reported: store GB/s, warm read GB/s (page cache hot), cold read GB/s (the store's files evicted
from the page cache with ``posix_fadvise(DONTNEED)``), and ``batch_exists`` µs per page. Reads are
checked bit-exact against the pages written. Each contestant runs ``--repeat`` times, interleaved
with the others, and the median of each figure is reported. Main thread only (SGLang's storage threads are one
prefetch and one backup thread).

Run: ``.venv-sglang/bin/python benchmarks/sglang/bench_sglang_backend.py --json out.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

from kvtier.integrations.sglang import KvtierHiCacheStorage
from kvtier.machine import format_table, write_report

BATCH = 128  # SGLang's STORAGE_BATCH_SIZE
SHAPES = {
    # name: (kind, layout, layers, heads, head_dim, page_size); all bfloat16
    "mha-page_first-64KiB": ("mha", "page_first", 4, 4, 128, 8),
    "mha-layer_first-64KiB": ("mha", "layer_first", 4, 4, 128, 8),
    "mla-page_first_direct-64KiB": ("mla", "page_first_direct", 4, 1, 512, 16),
    "mha-page_first-1MiB": ("mha", "page_first", 16, 8, 128, 16),
}


def make_pool(kind: str, layout: str, layers: int, heads: int, dim: int, ps: int, pages: int) -> Any:
    tokens, cpu, dt = pages * ps, torch.device("cpu"), torch.bfloat16

    def ptrs(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    if kind == "mla":
        rows = tuple(torch.zeros(ps, 1, dim, dtype=dt) for _ in range(layers))
        info = MLABufferInfo(buffers=rows, data_ptrs=ptrs(rows), layer_indices=tuple(range(layers)),
                             device_layer_num=layers, page_size=ps, kv_lora_rank=dim - 64,
                             qk_rope_head_dim=64, kv_cache_dim=dim, dtype=dt, device=cpu)
        return MLATokenToKVPoolHost(info, 1.0, 0, ps, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=1, start_layer=0, end_layer=layers,
                                    target_layer_num=layers, host_token_capacity=tokens)
    k = tuple(torch.zeros(ps, heads, dim, dtype=dt) for _ in range(layers))
    v = tuple(torch.zeros(ps, heads, dim, dtype=dt) for _ in range(layers))
    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                                           layout=KVBufferLayout.NHD),
                         page_size=ps, head_num=heads, head_dim=dim, v_head_dim=dim, dtype=dt, device=cpu)
    return MHATokenToKVPoolHost(info, 1.0, 0, ps, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=1, start_layer=0, end_layer=layers,
                                host_token_capacity=tokens)


def storage_config(kind: str, extra: dict[str, Any]) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=kind == "mla",
                                enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="bench/model", extra_config=extra)


def page_bytes(pool: Any) -> int:
    return pool.get_dummy_flat_data_page().numel() * 2


def drop_cache(directory: Path) -> None:
    os.sync()
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class ControllerDriver:
    """One contestant driven through SGLang's cache-controller page functions."""

    def __init__(self, backend: Any, pool: Any, zero_copy: bool) -> None:
        self.ctrl = SimpleNamespace(storage_backend=backend, storage_host_pool=pool,
                                    page_size=pool.page_size)
        self.op = SimpleNamespace(request_id="bench", is_terminated=lambda: False)
        self.zero_copy = zero_copy
        self.backend = backend

    def store(self, keys: list[str], slots: torch.Tensor) -> bool:
        fn = HiCacheController._page_set_zero_copy if self.zero_copy else HiCacheController._generic_page_set
        return fn(self.ctrl, keys, slots)

    def load(self, keys: list[str], slots: torch.Tensor) -> int:
        fn = HiCacheController._page_get_zero_copy if self.zero_copy else HiCacheController._generic_page_get
        return fn(self.ctrl, self.op, keys, slots)

    def exists(self, keys: list[str]) -> int:
        return self.backend.batch_exists(keys)

    def close(self) -> None:
        if hasattr(self.backend, "close"):
            self.backend.close()


class RawDriver:
    """Bytes only: one file, page i at offset i * page_bytes, no pool copies, no checks."""

    def __init__(self, directory: Path, nbytes: int, pages: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(directory / "raw.bin", os.O_RDWR | os.O_CREAT, 0o644)
        self.nbytes = nbytes
        raw = torch.empty(pages * nbytes + 4096, dtype=torch.uint8)
        skip = (-raw.data_ptr()) % 4096
        self.buf = raw[skip:skip + pages * nbytes].view(pages, nbytes)
        torch.randint(0, 256, self.buf.shape, dtype=torch.uint8, out=self.buf)
        self.index = {}

    def store(self, keys: list[str], slots: torch.Tensor) -> bool:
        for key in keys:
            page = self.index.setdefault(key, len(self.index))
            os.pwrite(self.fd, memoryview(self.buf[page].numpy()), page * self.nbytes)
        return True

    def load(self, keys: list[str], slots: torch.Tensor) -> int:
        for key in keys:
            page = self.index[key]
            os.preadv(self.fd, [memoryview(self.buf[page].numpy())], page * self.nbytes)
        return len(keys)

    def exists(self, keys: list[str]) -> int:
        return next((i for i, k in enumerate(keys) if k not in self.index), len(keys))

    def close(self) -> None:
        os.close(self.fd)


def contestants(kind: str, pool: Any, root: Path, pages: int) -> dict[str, Any]:
    def kvtier(name: str, v1: bool) -> Any:
        extra = {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
                 "class_name": "KvtierHiCacheStorage", "interface_v1": int(v1),
                 "kvtier": {"disk_url": f"file://{root / name}", "disk_min_free_bytes": 0}}
        backend = KvtierHiCacheStorage(storage_config(kind, extra), {})
        backend.register_mem_pool_host(pool)
        return ControllerDriver(backend, pool, zero_copy=v1)

    def sglang_file() -> Any:
        backend = HiCacheFile(storage_config(kind, {"file_storage_path": str(root / "sglang-file")}))
        backend.register_mem_pool_host(pool)
        return ControllerDriver(backend, pool, zero_copy=False)

    return {"sglang-file": sglang_file, "kvtier-v1": lambda: kvtier("kvtier-v1", True),
            "kvtier-generic": lambda: kvtier("kvtier-generic", False),
            "raw-file": lambda: RawDriver(root / "raw-file", page_bytes(pool), pages)}


def slots_of(pool: Any, first_page: int, count: int) -> torch.Tensor:
    ps = pool.page_size
    return torch.arange(first_page * ps, (first_page + count) * ps, dtype=torch.int64)


def run_contestant(driver: Any, pool: Any, keys: list[str], directory: Path) -> dict[str, float]:
    n, nbytes = len(keys), page_bytes(pool)

    def sweep(fn: Any, first_page: int) -> float:
        start = time.perf_counter()
        for i in range(0, n, BATCH):
            done = fn(keys[i:i + BATCH], slots_of(pool, first_page + i, len(keys[i:i + BATCH])))
            assert done not in (False, 0), "a batch failed"
        return time.perf_counter() - start

    write_s = sweep(driver.store, 0)
    start = time.perf_counter()
    for i in range(0, n, BATCH):
        assert driver.exists(keys[i:i + BATCH]) == len(keys[i:i + BATCH])
    exists_s = time.perf_counter() - start
    warm_s = sweep(driver.load, n)
    if not isinstance(driver, RawDriver):
        verify(pool, n)
    drop_cache(directory)
    cold_s = sweep(driver.load, n)
    gb = n * nbytes / 1e9
    return {"write_gbps": gb / write_s, "warm_read_gbps": gb / warm_s, "cold_read_gbps": gb / cold_s,
            "exists_us_per_page": exists_s / n * 1e6}


def verify(pool: Any, n: int) -> None:
    """Pages read into slots [n, 2n) equal the pages written from [0, n)."""
    for page in (0, n // 2, n - 1):
        src = pool.get_data_page(page * pool.page_size, flat=True)
        dst = pool.get_data_page((n + page) * pool.page_size, flat=True)
        assert torch.equal(src.view(torch.int16), dst.view(torch.int16)), f"page {page} differs"


def bench_shape(name: str, shape: tuple, total_bytes: int, root: Path, repeat: int) -> list[dict[str, Any]]:
    kind, layout, layers, heads, dim, ps = shape
    probe = make_pool(kind, layout, layers, heads, dim, ps, max(layers, 1))
    nbytes = page_bytes(probe)
    n = max(BATCH, total_bytes // nbytes // BATCH * BATCH)
    pool = make_pool(kind, layout, layers, heads, dim, ps, 2 * n)
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    raw[: raw.numel() // 2].random_(0, 256)
    keys = [hashlib.sha256(f"{name}:{i}".encode()).hexdigest() for i in range(n)]
    samples: dict[str, list[dict[str, float]]] = {}
    for _ in range(repeat):  # contestants interleaved, so a noisy minute hits all of them
        for contestant, build in contestants(kind, pool, root, n).items():
            raw[raw.numel() // 2:].zero_()
            driver = build()
            try:
                samples.setdefault(contestant, []).append(
                    run_contestant(driver, pool, keys, root / contestant))
            finally:
                driver.close()
                shutil.rmtree(root / contestant, ignore_errors=True)
    print(f"  {name}: done", flush=True)
    return [{"shape": name, "backend": contestant, "page_bytes": nbytes, "pages": n,
             "repeats": repeat, **{metric: statistics.median(r[metric] for r in runs)
                                   for metric in runs[0]}}
            for contestant, runs in samples.items()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total", default="128MiB", help="Bytes of pages per shape.")
    parser.add_argument("--dir", default=None, help="Directory on the disk to test (default: a temp dir).")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="Comma-separated shape names.")
    parser.add_argument("--repeat", type=int, default=3, help="Runs per contestant (median reported).")
    parser.add_argument("--json", metavar="OUT", help="Write results as JSON here.")
    args = parser.parse_args()
    from kvtier.units import parse_size

    total = parse_size(args.total) or 128 << 20
    root = Path(tempfile.mkdtemp(prefix="kvtier-sglang-bench-", dir=args.dir))
    rows, runs = [], []
    try:
        for name in args.shapes.split(","):
            for r in bench_shape(name, SHAPES[name], total, root, args.repeat):
                runs.append(r)
                rows.append([r["shape"], r["backend"], r["page_bytes"], r["pages"], r["write_gbps"],
                             r["warm_read_gbps"], r["cold_read_gbps"], r["exists_us_per_page"]])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(format_table(["shape", "backend", "page_B", "pages", "write GB/s", "warm GB/s",
                        "cold GB/s", "exists us/pg"], rows))
    if args.json:
        from importlib.metadata import version

        write_report(args.json, "sglang_backend", {"sglang": version("sglang"), "batch": BATCH,
                                                   "directory": str(args.dir or tempfile.gettempdir()),
                                                   "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
