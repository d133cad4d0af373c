"""kvtier's disk tier beside SGLang's and LMCache's, on the same pages, disk and threads, in one run.

Writes the same pages (``--total`` bytes of ``--page-bytes`` pages) through four paths, syncs,
looks every page up, then reads everything back warm and cold (cold drops the page cache; root):

- ``raw``: plain ``os.preadv``/``pwritev`` of the same bytes (kvtier's raw-disk baseline, over
  kvtier's own segment files);
- ``kvtier``: ``file://`` store (``FileStore``), pages read into page-aligned buffers;
- ``sglang``: SGLang 0.5.23 ``HiCacheFile`` (one file per page), read into CPU tensors;
- ``lmcache``: LMCache 0.5.6 ``LocalDiskBackend`` (async writes awaited, reads into its own
  CPU memory objects, which are then released).

Every system gets ``--threads`` caller threads, ``--batch`` pages per call. Run it in the
anchors venv (``scripts/setup_anchors.sh``), which also sees kvtier from ``src/``::

    .anchors/venv/bin/python benchmarks/store/compare_disk_anchors.py --dir /var/tmp/kvtier-anchors \
        --total 1GiB --page-bytes 64KiB --threads 4 --json benchmarks/results/disk_anchors.json

Prints a table (GB/s) and writes JSON with machine info. Main thread plus caller threads.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from kvtier.bench.page_io import (
    SOURCE_PAGES,
    aligned_pages,
    drop_caches,
    run_batches,
    source_pages,
)
from kvtier.bench.store_throughput import bench_one, flush_files
from kvtier.machine import format_table, write_report
from kvtier.units import parse_size


def timed_phases(name: str, root: Path, pages: int, page_bytes: int, threads: int, batch: int,
                 write: Callable, read: Callable, contains: Callable, repeats: int) -> dict:
    """Write all pages, flush the files under ``root`` to disk, contains over all keys, warm
    read (best of ``repeats``), cold read (best of ``repeats``, caches dropped before each)."""
    keys = list(range(pages))
    gb = pages * page_bytes / 1e9
    write_s = run_batches(threads, keys, batch, write)
    begin = time.perf_counter()
    flush_files(f"file://{root}")
    sync_s = time.perf_counter() - begin
    begin = time.perf_counter()
    present = contains(keys)
    contains_s = time.perf_counter() - begin
    run_batches(threads, keys, batch, read)
    warm = min(run_batches(threads, keys, batch, read) for _ in range(repeats))
    cold, dropped = float("inf"), True
    for _ in range(repeats):
        dropped = drop_caches() and dropped
        cold = min(cold, run_batches(threads, keys, batch, read))
    return {"system": name, "pages": pages, "page_bytes": page_bytes, "threads": threads,
            "write_gbps": gb / (write_s + sync_s), "warm_read_gbps": gb / warm,
            "cold_read_gbps": gb / cold if dropped else None, "caches_dropped": dropped,
            "contains_ms_per_100k": contains_s * 1e3 * 100_000 / pages, "present": present}


def sglang_run(root: Path, pages: int, page_bytes: int, threads: int, batch: int,
               repeats: int) -> dict:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="bench", extra_config={"file_storage_path": str(root)})
    store = HiCacheFile(config)
    sources = [torch.frombuffer(p, dtype=torch.uint8) for p in source_pages(page_bytes)]
    dest = [[torch.frombuffer(v, dtype=torch.uint8) for v in aligned_pages(batch, page_bytes)]
            for _ in range(threads)]
    names = [f"page{i:09d}" for i in range(pages)]

    def write(t: int, ks: Sequence[int], idx: range) -> None:
        assert store.batch_set([names[i] for i in idx], [sources[i % SOURCE_PAGES] for i in idx])

    def read(t: int, ks: Sequence[int], idx: range) -> None:
        got = store.batch_get([names[i] for i in idx], dest[t][:len(idx)])
        assert all(g is not None for g in got)

    return timed_phases("sglang HiCacheFile", root, pages, page_bytes, threads, batch, write, read,
                        lambda ks: sum(store.exists(names[i]) for i in ks), repeats)


def lmcache_run(root: Path, pages: int, page_bytes: int, threads: int, batch: int,
                repeats: int) -> dict:
    import asyncio
    import threading

    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_allocators.host_memory_allocator import HostMemoryAllocator
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

    total_gib = pages * page_bytes / 2**30
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=256, local_cpu=False, max_local_cpu_size=0.5, local_disk=f"{root}/",
        max_local_disk_size=total_gib * 2 + 1, extra_config={"disk_io_threads": threads})
    cpu = LocalCPUBackend(config, memory_allocator=HostMemoryAllocator(512 << 20),
                          dst_device="cpu")
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    disk = LocalDiskBackend(config, loop, cpu, dst_device="cpu")
    sources = [torch.frombuffer(p, dtype=torch.uint8) for p in source_pages(page_bytes)]
    keys = [CacheEngineKey("bench", 1, 0, i, torch.uint8) for i in range(pages)]
    written = threading.Semaphore(0)

    def write(t: int, ks: Sequence[int], idx: range) -> None:
        objs = []
        for i in idx:
            obj = cpu.allocate(torch.Size([page_bytes]), torch.uint8, fmt=MemoryFormat.KV_2LTD)
            obj.tensor.view(torch.uint8).copy_(sources[i % SOURCE_PAGES])
            objs.append(obj)
        disk.batched_submit_put_task([keys[i] for i in idx], objs,
                                     on_complete_callback=lambda k: written.release())
        for obj in objs:
            obj.ref_count_down()
        for _ in idx:  # a write is done when it is on disk, as for the others
            assert written.acquire(timeout=120)

    def read(t: int, ks: Sequence[int], idx: range) -> None:
        got = disk.batched_get_blocking([keys[i] for i in idx])
        assert all(g is not None for g in got)
        for obj in got:
            obj.ref_count_down()

    try:
        return timed_phases("lmcache LocalDiskBackend", root, pages, page_bytes, threads, batch,
                            write, read, lambda ks: sum(disk.contains(keys[i]) for i in ks),
                            repeats)
    finally:
        disk.close()
        loop.call_soon_threadsafe(loop.stop)


def kvtier_runs(root: Path, pages: int, page_bytes: int, threads: int, batch: int,
                repeats: int) -> list[dict]:
    """kvtier and the raw baseline, warm then cold, through ``kvtier bench store``'s runner."""
    runs = [bench_one(f"file://{root}", page_bytes, pages, threads, batch, cold, repeats)
            for cold in (False, True)]
    warm, cold = runs
    common = {"pages": pages, "page_bytes": page_bytes, "threads": threads}
    return [
        {"system": "raw preadv/pwritev", **common, "write_gbps": warm["raw_write_gbps"],
         "warm_read_gbps": warm["raw_read_gbps"], "cold_read_gbps": cold["raw_read_gbps"],
         "caches_dropped": cold["caches_dropped"], "contains_ms_per_100k": None},
        {"system": "kvtier file://", **common, "write_gbps": warm["write_gbps"],
         "warm_read_gbps": warm["read_gbps"], "cold_read_gbps": cold["read_gbps"],
         "caches_dropped": cold["caches_dropped"],
         "contains_ms_per_100k": warm["contains_ms_per_100k"], "open_s": warm["open_s"]},
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="Scratch directory on the disk under test.")
    parser.add_argument("--total", default="1GiB")
    parser.add_argument("--page-bytes", default="64KiB")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="Write results here.")
    args = parser.parse_args()
    page_bytes = parse_size(args.page_bytes)
    pages = parse_size(args.total) // page_bytes
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    shape = (pages, page_bytes, args.threads, args.batch, args.repeats)
    runs = kvtier_runs(root / "kvtier", *shape)
    for name, runner in (("sglang", sglang_run), ("lmcache", lmcache_run)):
        runs.append(runner(root / name, *shape))
        shutil.rmtree(root / name, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    rows = [[r["system"], r["write_gbps"], r["warm_read_gbps"],
             r["cold_read_gbps"] if r["cold_read_gbps"] is not None else "-",
             r["contains_ms_per_100k"] if r["contains_ms_per_100k"] is not None else "-"]
            for r in runs]
    print(f"{pages} pages of {page_bytes} bytes, {args.threads} threads, {args.batch} per call")
    print(format_table(["system", "write GB/s", "warm read GB/s", "cold read GB/s",
                        "contains ms/100k"], rows))
    if args.json:
        write_report(args.json, "disk_anchors", {"runs": runs, "args": vars(args)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
