"""Host <-> device page transfer: kvtier's kernels beside the raw ways to move the same bytes.

For scattered parts of 16, 64 and 256 KiB (one layer's K or V of one page; every copy between
tiers moves whole parts) this measures, in one run on one machine:

- peak: one contiguous pinned ``cudaMemcpyAsync`` of the same bytes (H2D, D2H, both at once);
- per_part_memcpy: one ``cudaMemcpyAsync`` per part (what a naive engine issues);
- gather_copy: gather on the source side, one contiguous copy, scatter on the other side;
- ce_batch: every part in one ``cuMemcpyBatchAsync`` call (the copy engines, if the driver has it);
- kvtier: one kvtier kernel launch (both host layouts), and one launch per layer;
- duplex: a load and a store of the same size at once, with the kernels' grids split between
  the two directions, and a kernel in one direction beside the copy engines in the other.

Prints a table and writes JSON with machine info. Needs CUDA; run from the source tree:
``PYTHONPATH=src python benchmarks/bench_transfer.py --out-dir benchmarks/results``. Main thread.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.layout import KVLayout
from kvtier.machine import format_table, write_report
from kvtier.memory.device_pool import DevicePool
from kvtier.memory.host_pool import HostPool
from kvtier.memory.pinned import PinnedBudget
from kvtier.transfer.kernels import KernelConfig, launch_copy, upload_ids
from kvtier.transfer.plan import CopyPlan, device_geometry, host_geometry, make_plan

GIB = 1 << 30


def gpu_time(fn: Callable[[], None], reps: int, warmup: int = 2) -> float:
    """Median seconds of ``fn`` on the current stream, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def wall_time(fn: Callable[[], None], reps: int, warmup: int = 1) -> float:
    """Median wall seconds of ``fn`` from a synchronized start to a synchronized end."""
    for _ in range(warmup):
        fn()
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---- the copy engines through cuMemcpyBatchAsync (CUDA 12.8 ABI, asked for by version) ---------
class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


def batch_memcpy_fn() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    get = lib.cuGetProcAddress_v2
    get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                    ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
    pfn, status = ctypes.c_void_p(), ctypes.c_int()
    err = get(b"cuMemcpyBatchAsync", ctypes.byref(pfn), 12080, 0, ctypes.byref(status))
    if err or not pfn.value:
        raise RuntimeError(f"cuGetProcAddress(cuMemcpyBatchAsync) failed: {err}/{status.value}")
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_size_t, ctypes.POINTER(_MemcpyAttributes), ctypes.c_void_p,
                             ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p)
    return proto(pfn.value)


def part_addresses(plan: CopyPlan, src_base: int, dst_base: int) -> tuple[np.ndarray, ...]:
    layers = np.arange(plan.layer_start, plan.layer_start + plan.layer_count, dtype=np.uint64)
    parts = np.arange(plan.src.parts, dtype=np.uint64)

    def offsets(geo: Any, ids: np.ndarray) -> np.ndarray:
        return (ids.astype(np.uint64)[:, None, None] * np.uint64(geo.page_stride)
                + layers[None, :, None] * np.uint64(geo.layer_stride)
                + parts[None, None, :] * np.uint64(geo.part_stride)).reshape(-1)

    srcs = offsets(plan.src, plan.src_ids) + np.uint64(src_base)
    dsts = offsets(plan.dst, plan.dst_ids) + np.uint64(dst_base)
    sizes = np.full(srcs.size, plan.src.part_bytes, dtype=np.uint64)
    return dsts, srcs, sizes


def ce_batch_copy(fn: Any, arrays: tuple[np.ndarray, ...], stream: int) -> None:
    dsts, srcs, sizes = arrays
    attrs = _MemcpyAttributes(1, _MemLocation(0, 0), _MemLocation(0, 0), 0)  # stream order
    idx, fail = np.zeros(1, dtype=np.uint64), ctypes.c_size_t(0)
    err = fn(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, dsts.size,
             ctypes.byref(attrs), idx.ctypes.data, 1, ctypes.byref(fail), stream)
    if err:
        raise RuntimeError(f"cuMemcpyBatchAsync failed with {err} at copy {fail.value}")


# ---- one part size -------------------------------------------------------------------------------
class Setup:
    """Pools of one part size and random scattered batches over them."""

    def __init__(self, part_kib: int, batch_bytes: int, host_layout: str, budget: PinnedBudget):
        self.layout = KVLayout(8, 8, 128, "bfloat16", part_kib * 1024 // 2048)
        self.n = max(1, batch_bytes // self.layout.page_bytes)
        pages = 2 * self.n
        self.host = HostPool(self.layout, pages, budget, host_layout, pin=True)
        self.dev = DevicePool(self.layout, pages, "cuda")
        self.host.buffer.fill_(7)
        self.dev.kv.view(torch.uint8).fill_(9)
        rng = np.random.default_rng(0)
        host_perm, dev_perm = rng.permutation(pages), rng.permutation(pages)
        dg, hg = device_geometry(self.layout, pages), host_geometry(self.layout, pages, host_layout)
        n = self.n
        self.load = make_plan("load", hg, dg, host_perm[:n], dev_perm[:n])
        self.store = make_plan("store", dg, hg, dev_perm[n:], host_perm[n:])

    def close(self) -> None:
        self.host.close()
        del self.dev

    def kernel(self, plan: CopyPlan, config: KernelConfig | None) -> Callable[[], None]:
        ids = upload_ids(plan, self.dev.kv.device)
        return lambda: launch_copy(plan, self.dev.kv, self.host.buffer, config, ids=ids)

    def per_layer(self, plan: CopyPlan, config: KernelConfig | None) -> Callable[[], None]:
        ids = upload_ids(plan, self.dev.kv.device)
        plans = [CopyPlan(plan.direction, plan.src, plan.dst, plan.src_ids, plan.dst_ids, layer, 1)
                 for layer in range(self.layout.num_layers)]
        return lambda: [launch_copy(p, self.dev.kv, self.host.buffer, config, ids=ids)
                        for p in plans]


def measure_peak(nbytes: int, reps: int) -> dict[str, float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(2)
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = gpu_time(lambda: dev2.copy_(host, non_blocking=True), reps)
    d2h = gpu_time(lambda: host2.copy_(dev, non_blocking=True), reps)
    duplex, _, _ = duplex_time((torch.cuda.Stream(), torch.cuda.Stream()),
                               lambda: dev2.copy_(host, non_blocking=True),
                               lambda: host2.copy_(dev, non_blocking=True), reps)
    return {"h2d_gbs": nbytes / h2d / 1e9, "d2h_gbs": nbytes / d2h / 1e9,
            "duplex_gbs": 2 * nbytes / duplex / 1e9}


def per_part_memcpy(setup: Setup, plan: CopyPlan, max_copies: int) -> tuple[Callable, int]:
    """One cudaMemcpyAsync per part for the first pages of the batch (views built up front).

    The host side is a torch-pinned buffer of the same geometry: torch treats memory pinned with
    cudaHostRegister as pageable and would make every one of these copies synchronous.
    """
    lay, dev = setup.layout, setup.dev.bytes_view()
    pages = max(1, max_copies // (lay.num_layers * lay.parts))
    geo = plan.src if plan.direction == "load" else plan.dst
    mirror = torch.empty(setup.host.nbytes, dtype=torch.uint8, pin_memory=True)

    def host_part(page: int, layer: int, part: int) -> torch.Tensor:
        start = geo.part_offset(page, layer, part)
        return mirror[start:start + lay.part_bytes]

    pairs = []
    for s, d in zip(plan.src_ids[:pages].tolist(), plan.dst_ids[:pages].tolist(), strict=True):
        for layer in range(lay.num_layers):
            for part in range(lay.parts):
                if plan.direction == "load":
                    pairs.append((dev[layer, part, d], host_part(s, layer, part)))
                else:
                    pairs.append((host_part(d, layer, part), dev[layer, part, s]))

    def run() -> None:
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)

    return run, pages * lay.page_bytes


def gather_copy(setup: Setup, plan: CopyPlan, max_pages: int) -> tuple[Callable, int]:
    """Gather whole pages on the source side, one copy, scatter on the other side."""
    lay, dev = setup.layout, setup.dev.bytes_view()
    n = min(plan.num_pages, max_pages)
    src = torch.from_numpy(plan.src_ids[:n])
    dst = torch.from_numpy(plan.dst_ids[:n])
    host_pages = setup.host.buffer.view(-1, lay.page_bytes)
    staging = torch.empty(n, lay.page_bytes, dtype=torch.uint8, pin_memory=True)
    dev_staging = torch.empty(n, lay.num_layers, lay.parts, lay.part_bytes, dtype=torch.uint8,
                              device="cuda")
    src_d, dst_d = src.cuda(), dst.cuda()

    def load() -> None:
        torch.index_select(host_pages, 0, src, out=staging)
        dev_staging.view(n, -1).copy_(staging, non_blocking=True)
        dev[:, :, dst_d] = dev_staging.permute(1, 2, 0, 3)

    def store() -> None:
        dev_staging.copy_(dev[:, :, src_d].permute(2, 0, 1, 3))
        staging.copy_(dev_staging.view(n, -1), non_blocking=True)
        torch.cuda.current_stream().synchronize()
        host_pages.index_copy_(0, dst, staging)

    return (load if plan.direction == "load" else store), n * lay.page_bytes


def gbs(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def row(part_kib: int, direction: str, method: str, nbytes: int, seconds: float,
        peak_gbs: float) -> dict[str, Any]:
    rate = gbs(nbytes, seconds)
    return {"part_kib": part_kib, "direction": direction, "method": method,
            "mib": nbytes / 2**20, "gbs": rate, "pct_of_peak": 100.0 * rate / peak_gbs}


PROGRAM_COUNTS = (16, 66, 132, 528)


def tune(setup: Setup, reps: int) -> tuple[list[dict[str, Any]], dict[str, KernelConfig]]:
    """Launch shapes tried on one part size; returns every result and the best per direction."""
    results, best = [], {}
    for plan in (setup.load, setup.store):
        top = (0.0, KernelConfig())
        for block in (8192, 16384, 32768):
            for warps in (4,):
                for programs in PROGRAM_COUNTS:
                    config = KernelConfig(block_bytes=block, num_warps=warps, max_programs=programs)
                    rate = gbs(plan.nbytes, gpu_time(setup.kernel(plan, config), reps, 1))
                    results.append({"direction": plan.direction, "block_bytes": block,
                                    "num_warps": warps, "max_programs": programs, "gbs": rate})
                    top = max(top, (rate, config), key=lambda item: item[0])
        best[plan.direction] = top[1]
    return results, best


def one_direction(setup: Setup, plan: CopyPlan, peak: float, best: KernelConfig,
                  args: argparse.Namespace, ce: Any) -> list[dict[str, Any]]:
    kib, d, reps = setup.layout.part_bytes // 1024, plan.direction, args.reps
    rows = [row(kib, d, "kvtier kernel (default)", plan.nbytes,
                gpu_time(setup.kernel(plan, None), reps), peak),
            row(kib, d, "kvtier kernel (tuned)", plan.nbytes,
                gpu_time(setup.kernel(plan, best), reps), peak),
            row(kib, d, "kvtier per-layer launches", plan.nbytes,
                gpu_time(setup.per_layer(plan, best), reps), peak)]
    fn, nbytes = per_part_memcpy(setup, plan, args.max_copies)
    rows.append(row(kib, d, "cudaMemcpyAsync per part", nbytes, wall_time(fn, 3), peak))
    fn, nbytes = gather_copy(setup, plan, max(1, args.gather_mib * 2**20 // setup.layout.page_bytes))
    rows.append(row(kib, d, "gather + one copy", nbytes, wall_time(fn, 3), peak))
    if ce is not None:
        rows.append(_ce_row(setup, plan, peak, ce, reps))
    return rows


def _ce_row(setup: Setup, plan: CopyPlan, peak: float, ce: Any, reps: int) -> dict[str, Any]:
    kib = setup.layout.part_bytes // 1024
    try:
        arrays = ce_arrays(setup, plan)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            seconds = gpu_time(lambda: ce_batch_copy(ce, arrays, side.cuda_stream), reps)
        return row(kib, plan.direction, "cuMemcpyBatchAsync (copy engines)", plan.nbytes, seconds,
                   peak)
    except Exception as exc:  # report and carry on: the driver may lack the entry point
        return {"part_kib": kib, "direction": plan.direction, "method": "cuMemcpyBatchAsync",
                "error": repr(exc)}


def ce_arrays(setup: Setup, plan: CopyPlan) -> tuple[np.ndarray, ...]:
    host, dev = setup.host.buffer.data_ptr(), setup.dev.kv.data_ptr()
    return part_addresses(plan, *((host, dev) if plan.direction == "load" else (dev, host)))


DUPLEX_PROGRAMS = ((None, None), (1056, 1056), (264, 264), (132, 132), (96, 96), (66, 66),
                   (48, 48), (32, 32), (16, 16), (132, 66), (66, 132), (96, 48), (48, 96))


def duplex_time(streams: tuple, load_fn: Callable, store_fn: Callable,
                reps: int) -> tuple[float, float, float]:
    """Median seconds of a load and a store started together: (both, load, store)."""
    runs = []
    for rep in range(reps + 1):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        ends = [torch.cuda.Event(enable_timing=True) for _ in streams]
        start.record()
        for stream, fn, end in zip(streams, (load_fn, store_fn), ends, strict=True):
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                fn()
                end.record(stream)
        torch.cuda.synchronize()
        if rep:  # the first run warms up
            times = [start.elapsed_time(end) / 1e3 for end in ends]
            runs.append((max(times), *times))
    return tuple(statistics.median(run[i] for run in runs) for i in range(3))


def duplex_row(kib: int, label: str, nbytes: tuple[int, int], timed: tuple[float, ...],
               peak: float) -> dict[str, Any]:
    both, load_s, store_s = timed
    rates = (gbs(nbytes[0], load_s), gbs(nbytes[1], store_s))
    out = row(kib, "duplex", f"{label} (load {rates[0]:.1f}, store {rates[1]:.1f})",
              sum(nbytes), both, peak)
    out.update({"load_gbs": rates[0], "store_gbs": rates[1]})
    return out


def duplex(setup: Setup, peak: float, best: dict[str, KernelConfig], args: argparse.Namespace,
           ce: Any) -> list[dict[str, Any]]:
    """A load and a store at once on two streams, under several splits of the grid."""
    kib = setup.layout.part_bytes // 1024
    nbytes = (setup.load.nbytes, setup.store.nbytes)
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    rows = []
    for load_programs, store_programs in DUPLEX_PROGRAMS:
        load_cfg = _capped(best["load"], load_programs)
        store_cfg = _capped(best["store"], store_programs)
        timed = duplex_time(streams, setup.kernel(setup.load, load_cfg),
                            setup.kernel(setup.store, store_cfg), args.reps)
        label = ("kernels, kvtier defaults" if load_programs is None
                 else f"kernels, {load_programs}/{store_programs} programs")
        rows.append(duplex_row(kib, label, nbytes, timed, peak))
    if ce is not None:
        rows += _duplex_with_ce(setup, peak, best, args, ce, streams)
    return rows


def _duplex_with_ce(setup: Setup, peak: float, best: dict[str, KernelConfig],
                    args: argparse.Namespace, ce: Any, streams: tuple) -> list[dict[str, Any]]:
    """Kernels beside the copy engines: scattered (cuMemcpyBatchAsync) and contiguous copies."""
    kib = setup.layout.part_bytes // 1024
    nbytes = (setup.load.nbytes, setup.store.nbytes)
    try:
        load_arr, store_arr = ce_arrays(setup, setup.load), ce_arrays(setup, setup.store)
        kern_load = setup.kernel(setup.load, best["load"])
        kern_store = setup.kernel(setup.store, best["store"])
        ce_load = lambda: ce_batch_copy(ce, load_arr, streams[0].cuda_stream)  # noqa: E731
        ce_store = lambda: ce_batch_copy(ce, store_arr, streams[1].cuda_stream)  # noqa: E731
        host = torch.empty(nbytes[0], dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes[0], dtype=torch.uint8, device="cuda")
        flat_load = lambda: dev.copy_(host, non_blocking=True)  # noqa: E731
        flat_store = lambda: host.copy_(dev, non_blocking=True)  # noqa: E731
        cases = (("kernel load + batched copy-engine store", kern_load, ce_store),
                 ("batched copy-engine load + kernel store", ce_load, kern_store),
                 ("batched copy engines both ways", ce_load, ce_store),
                 ("kernel load + contiguous memcpy D2H (reference)", kern_load, flat_store),
                 ("contiguous memcpy H2D + kernel store (reference)", flat_load, kern_store))
        return [duplex_row(kib, label, nbytes, duplex_time(streams, a, b, args.reps), peak)
                for label, a, b in cases]
    except Exception as exc:
        return [{"part_kib": kib, "direction": "duplex", "method": "copy engines",
                 "error": repr(exc)}]


def _capped(config: KernelConfig, programs: int | None) -> KernelConfig:
    """``config``'s block and warps with a grid of ``programs``; None: kvtier's defaults."""
    if programs is None:
        return KernelConfig()
    return KernelConfig(config.block_bytes, config.num_warps, programs)


# ---- main ----------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default="benchmarks/results", help="Where JSON + table go.")
    parser.add_argument("--sizes", default="16,64,256", help="Part sizes in KiB.")
    parser.add_argument("--batch-mib", type=int, default=1024, help="Bytes per batch (MiB).")
    parser.add_argument("--reps", type=int, default=10, help="Timed repeats (median).")
    parser.add_argument("--max-copies", type=int, default=4096,
                        help="Parts moved by the one-memcpy-per-part baseline.")
    parser.add_argument("--gather-mib", type=int, default=256,
                        help="Bytes moved by the gather + one copy baseline (MiB).")
    parser.add_argument("--no-tune", action="store_true", help="Skip the launch-shape sweep.")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("bench_transfer needs a CUDA device")
        return 2
    batch = args.batch_mib * 2**20
    budget = PinnedBudget(16 * GIB)
    peak = measure_peak(batch, args.reps)
    print(f"peak contiguous pinned copies (GB/s): {json.dumps(peak)}", flush=True)
    try:
        peak["ptx"] = ptx_summary(budget)
    except Exception as exc:
        peak["ptx"] = {"error": repr(exc)}
    print(f"kernel PTX: {peak['ptx']}", flush=True)
    tuning, best = [], {"load": KernelConfig(), "store": KernelConfig()}
    if not args.no_tune:
        setup = Setup(64, batch, "page_first", budget)
        tuning, best = tune(setup, max(3, args.reps // 2))
        setup.close()
    print(f"tuned: {best}", flush=True)
    ce = _try_batch_fn()
    rows, duplex_rows = [], []
    for kib in (int(s) for s in args.sizes.split(",")):
        try:
            size_rows, size_duplex = bench_size(kib, batch, budget, peak, best, args, ce)
        except Exception:
            traceback.print_exc()
            continue
        rows += size_rows
        duplex_rows += size_duplex
        print(f"part {kib} KiB done", flush=True)
    report(args, peak, tuning, best, rows, duplex_rows)
    return 0


def bench_size(kib: int, batch: int, budget: PinnedBudget, peak: dict, best: dict,
               args: argparse.Namespace, ce: Any) -> tuple[list, list]:
    rows = []
    setup = Setup(kib, batch, "page_first", budget)
    for plan, key in ((setup.load, "h2d_gbs"), (setup.store, "d2h_gbs")):
        rows += one_direction(setup, plan, peak[key], best[plan.direction], args, ce)
    duplex_rows = duplex(setup, peak["duplex_gbs"], best, args, ce)
    setup.close()
    lf = Setup(kib, batch, "layer_first", budget)
    for plan, key in ((lf.load, "h2d_gbs"), (lf.store, "d2h_gbs")):
        rows.append(row(kib, plan.direction, "kvtier kernel (tuned, layer_first host)",
                        plan.nbytes, gpu_time(lf.kernel(plan, best[plan.direction]), args.reps),
                        peak[key]))
    lf.close()
    return rows, duplex_rows


def ptx_summary(budget: PinnedBudget) -> dict[str, Any]:
    """Whether the compiled kernel moves 16-byte vectors (counts of v4 loads and stores)."""
    setup = Setup(64, 64 * 2**20, "page_first", budget)
    handle = launch_copy(setup.load, setup.dev.kv, setup.host.buffer)
    torch.cuda.synchronize()
    setup.close()
    ptx = getattr(handle, "asm", {}).get("ptx", "") if handle is not None else ""
    vector = r"\.global[\w:.]*\.v4\."
    return {"ld_global_v4": len(re.findall(r"ld" + vector, ptx)),
            "st_global_v4": len(re.findall(r"st" + vector, ptx)),
            "ld_global": len(re.findall(r"ld\.global", ptx)),
            "st_global": len(re.findall(r"st\.global", ptx))}


def _try_batch_fn() -> Any:
    try:
        return batch_memcpy_fn()
    except Exception as exc:
        print(f"cuMemcpyBatchAsync unavailable: {exc!r}")
        return None


def report(args: argparse.Namespace, peak: dict, tuning: list, best: dict, rows: list,
           duplex_rows: list) -> None:
    out = Path(args.out_dir)
    gpu = torch.cuda.get_device_name(0).lower().replace("nvidia", "").strip().replace(" ", "_")
    all_rows = rows + duplex_rows
    table = format_table(
        ["part KiB", "direction", "method", "MiB", "GB/s", "% of peak"],
        [[r["part_kib"], r["direction"], r["method"], round(r.get("mib", 0)),
          round(r.get("gbs", 0.0), 1), round(r.get("pct_of_peak", 0.0), 1)]
         if "error" not in r else [r["part_kib"], r["direction"], r["method"], "-", "error", "-"]
         for r in all_rows])
    header = (f"peak contiguous pinned copy: H2D {peak['h2d_gbs']:.1f} GB/s, "
              f"D2H {peak['d2h_gbs']:.1f} GB/s, both at once {peak['duplex_gbs']:.1f} GB/s\n"
              f"tuned launch shapes: load {best['load']}, store {best['store']}\n")
    command = "PYTHONPATH=src python benchmarks/bench_transfer.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "no_tune")
    write_report(out / f"transfer_{gpu}.json", "transfer",
                 {"command": command, "peak": peak, "rows": all_rows, "tuning": tuning,
                  "best": {k: repr(v) for k, v in best.items()}})
    (out / f"transfer_{gpu}.txt").write_text(f"{command}\n{header}\n{table}\n")
    print(header + "\n" + table)


if __name__ == "__main__":
    raise SystemExit(main())
