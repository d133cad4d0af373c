"""A burst written through to the ``file://`` disk tier, then read back from the page cache.

Writes one prompt of ``--pages`` pages (``--page-bytes`` each, 2 MiB: llama3-8b's 16-token page
in bf16) through a ``TieredCache`` (device -> host -> disk write-through), drains it, checks that
a fresh handle of the store holds every page, then times the read back by stage, the page cache
warm (the pages were just written):

    write            commit -> drain (device -> host copy, host -> disk backup)
    raw_preadv       os.preadv of each page's payload into host buffers (the bytes alone)
    store_read       FileStore.read_into in batches of --batch pages (records, verified)
    store_read_hdr   the same with verify=header (no payload checksum)
    prefetch_land    a fresh cache's prefetch: disk -> host tier (IO workers, --workers)
    load             a fresh cache's match + load: disk -> host -> device (CPU here)

``raw_preadv`` and ``store_read`` run with 1 and ``--threads`` threads, each thread on its
own contiguous slice of the pages. Prints a table of GB/s per stage, writes JSON with machine
info (``--json``).

    PYTHONPATH=src python benchmarks/store/disk_burst.py --dir /var/tmp/kvtier-burst --pages 512 \
        --json benchmarks/results/disk_burst_cpu.json
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvtier.cache import TieredCache
from kvtier.config import build_config
from kvtier.keys import KeyNamespace, page_keys
from kvtier.layout import KVLayout
from kvtier.machine import format_table, write_report
from kvtier.store.file.index import SLOT_BITS, SLOT_MASK
from kvtier.store.file.options import FileStoreOptions
from kvtier.store.file.store import FileStore
from kvtier.units import parse_size

PAGE = 16


def layout_for(page_bytes: int) -> KVLayout:
    per_layer = 2 * PAGE * 8 * 128 * 2          # K and V, 8 heads of 128, bf16
    if page_bytes % per_layer:
        raise SystemExit(f"--page-bytes must be a multiple of {per_layer}")
    return KVLayout(num_layers=page_bytes // per_layer, num_kv_heads=8, head_dim=128,
                    dtype="bfloat16", page_size=PAGE)


def build(layout: KVLayout, root: Path, pages: int, workers: int, **flags: Any) -> TieredCache:
    config = build_config(env={}, flags={
        "cache.page_size": PAGE, "cache.device_pages": pages + 4,
        "host.pool_bytes": (2 * pages + 4) * layout.page_bytes,
        "host.pinned_budget_bytes": (2 * pages + 64) * layout.page_bytes,
        "store.disk_url": f"file://{root}", "store.disk_max_bytes": 4 * pages * layout.page_bytes,
        "store.disk_min_free_bytes": 0, "controller.io_workers": workers,
        "controller.min_prefetch_tokens": 0, "controller.job_deadline_s": 60.0, **flags})
    namespace = KeyNamespace("burst", "fp", "bfloat16", layout.fingerprint(), PAGE)
    return TieredCache.build(config, layout, namespace, pin_host=False)


def threaded(threads: int, total: int, work: Callable[[int, int], None]) -> float:
    """Seconds for ``threads`` threads each running ``work(lo, hi)`` on its slice of ``total``."""
    cuts = [total * i // threads for i in range(threads + 1)]
    pool = [threading.Thread(target=work, args=(cuts[i], cuts[i + 1])) for i in range(threads)]
    start = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/var/tmp/kvtier-burst")
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--page-bytes", default="2MiB")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--workers", default="4", help="IO workers of the fresh cache, comma list")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    layout = layout_for(parse_size(args.page_bytes) or 0)
    pb, n = layout.page_bytes, args.pages
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    tokens = [random.Random(1).randrange(1, 30000) for _ in range(n * PAGE)]
    rows: list[dict[str, Any]] = []

    def row(stage: str, threads: int, seconds: list[float], note: str = "") -> None:
        best = min(seconds)
        rows.append({"stage": stage, "threads": threads, "seconds": best,
                     "median_s": statistics.median(seconds), "gb_s": n * pb / best / 1e9,
                     "note": note})

    with build(layout, root, n, 4) as cache:
        ids = cache.allocate(n)
        cache.device_pool.kv.view(torch.uint8).view(-1)[::4093] = 7
        start = time.perf_counter()
        cache.commit(tokens, ids)
        drained = cache.drain(600)
        row("write", 4, [time.perf_counter() - start], f"drain {drained}")
        namespace = cache.ctx.namespace
    keys = [bytes(k) for k in page_keys(tokens, PAGE, namespace)]
    host = torch.empty(n, pb, dtype=torch.uint8)
    host[:, ::4096] = 0  # touch every page of the destination once
    views = [memoryview(host[i].numpy()) for i in range(n)]
    for verify in ("full", "header"):
        store = FileStore(root, pb, FileStoreOptions(verify=verify))
        whole = store.contains_prefix(keys)
        if verify == "full":
            rows[0]["note"] += f", {whole}/{n} pages on disk"
            locs = [store.index.where[k] for k in keys]

            def raw(lo: int, hi: int, store: FileStore = store, locs: list[int] = locs) -> None:
                for i in range(lo, hi):
                    seg, slot = locs[i] >> SLOT_BITS, locs[i] & SLOT_MASK
                    fd = store.readers.pin(seg)
                    assert fd is not None
                    os.preadv(fd, [views[i]], store.layout.payload_at(slot))
                    store.readers.unpin(seg)

            for t in sorted({1, args.threads}):
                row("raw_preadv", t, [threaded(t, n, raw) for _ in range(args.rounds)])

        def read(lo: int, hi: int, store: FileStore = store) -> None:
            for b in range(lo, hi, args.batch):
                e = min(b + args.batch, hi)
                if not all(store.read_into(keys[b:e], views[b:e])):
                    raise SystemExit(f"pages {b}..{e} did not read back")

        name = "store_read" if verify == "full" else "store_read_hdr"
        for t in sorted({1, args.threads}):
            row(name, t, [threaded(t, n, read) for _ in range(args.rounds)], f"batch {args.batch}")
        store.close()
    for workers in [int(w) for w in args.workers.split(",")]:
        lands, loads = [], []
        for _ in range(args.rounds):
            with build(layout, root, n, workers,
                       **{"controller.prefetch_policy": "wait_complete"}) as cache:
                assert cache.host_pool is not None  # touched once, as pinning would have
                cache.host_pool.buffer.view(-1)[::4096] = 0
                cache.device_pool.kv.view(torch.uint8).view(-1)[::4096] = 0
                start = time.perf_counter()
                hit = cache.match(tokens)
                cache.prefetch(hit)
                while cache.landing(hit):
                    time.sleep(0.0002)
                lands.append(time.perf_counter() - start)
                loaded = cache.load(hit)
                loads.append(time.perf_counter() - start)
                if loaded.tokens != n * PAGE:
                    raise SystemExit(f"loaded {loaded.tokens} of {n * PAGE} tokens")
                cache.release(loaded)
        row("prefetch_land", workers, lands, "match + prefetch, disk -> host")
        row("load", workers, loads, "+ host -> device (CPU)")
    table = format_table(["stage", "threads", "GB/s", "best s", "median s", "note"],
                         [[r["stage"], r["threads"], round(r["gb_s"], 2), round(r["seconds"], 3),
                           round(r["median_s"], 3), r["note"]] for r in rows])
    print(f"{n} pages of {pb >> 20} MiB ({n * pb / 2**30:.2f} GiB), page cache warm\n{table}")
    if args.json:
        write_report(args.json, "disk_burst", {"args": vars(args), "rows": rows})
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
