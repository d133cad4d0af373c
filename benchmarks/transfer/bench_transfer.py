"""Host <-> device page transfer: kvtier's kernels beside the raw ways to move the same bytes.

For scattered parts of 16, 64 and 256 KiB (one layer's K or V of one page; every copy between
tiers moves whole parts) this measures, in one run on one machine:

- peak: one contiguous pinned ``cudaMemcpyAsync`` of the same bytes (H2D, D2H, both at once);
- per_part_memcpy: one ``cudaMemcpyAsync`` per part (what a naive engine issues);
- gather_copy: gather on the source side, one contiguous copy, scatter on the other side;
- ce_batch: every part in one ``cuMemcpyBatchAsync`` call (the copy engines, if the driver has it);
- kvtier: one kvtier kernel launch (both host layouts), and one launch per layer;
- kvtier copy-engine path (``host.copy_path=copy_engine``, ``kvtier.transfer.staged``): one
  copy-engine copy per page (``page_first`` pages are contiguous on the host) through kvtier's
  64 MiB device staging buffer per direction, kvtier's kernel scattering or gathering on the
  device side (``transfer_staged.py``);
- duplex: a load and a store of the same size at once, with the kernels' grids split between
  the two directions, a kernel in one direction beside the copy engines in the other, and
  kvtier's copy-engine path both ways.

The raw baselines and timers live in ``transfer_baselines.py``. Prints a table and writes JSON
with machine info. Needs CUDA; run from the source tree:
``PYTHONPATH=src python benchmarks/transfer/bench_transfer.py --out-dir benchmarks/results``. Main thread.
"""

from __future__ import annotations

import argparse
import json
import re
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.machine import format_table, write_report
from kvtier.memory.pinned import PinnedBudget
from kvtier.transfer.kernels import KernelConfig, launch_copy
from kvtier.transfer.plan import CopyPlan
from transfer_baselines import (
    GIB,
    Setup,
    duplex_time,
    gather_copy,
    gbs,
    gpu_time,
    measure_peak,
    part_addresses,
    per_part_memcpy,
    row,
    wall_time,
)
from transfer_staged import staged_fns, staged_rows

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
            seconds = gpu_time(lambda: ce.copy(*arrays, side.cuda_stream), reps)
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
        ce_load = lambda: ce.copy(*load_arr, streams[0].cuda_stream)  # noqa: E731
        ce_store = lambda: ce.copy(*store_arr, streams[1].cuda_stream)  # noqa: E731
        host = torch.empty(nbytes[0], dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes[0], dtype=torch.uint8, device="cuda")
        flat_load = lambda: dev.copy_(host, non_blocking=True)  # noqa: E731
        flat_store = lambda: host.copy_(dev, non_blocking=True)  # noqa: E731
        staged = [(f"kvtier copy-engine path both ways, {mib} MiB staging each",
                   *staged_fns(setup, ce, mib << 20)[:2]) for mib in args.staging_mib]
        staged_store = staged[0][2]
        cases = (*staged,
                 ("kernel load + kvtier copy-engine store", kern_load, staged_store),
                 ("kernel load + batched copy-engine store", kern_load, ce_store),
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
    parser.add_argument("--staging-mib", type=lambda v: [int(x) for x in v.split(",")],
                        default=[64, 256], help="Device staging per direction for the "
                        "copy-engine path rows (MiB; the first is kvtier's default).")
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
    if ce is not None:
        for mib in args.staging_mib:
            rows += staged_rows(setup, ce, peak, args.reps, mib << 20)
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
    from kvtier.transfer.ce_batch import load_batch_copy

    batch = load_batch_copy()
    if batch is None:
        print("cuMemcpyBatchAsync unavailable: copy-engine rows are skipped")
    return batch


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
    command = "PYTHONPATH=src python benchmarks/transfer/bench_transfer.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "no_tune")
    write_report(out / f"transfer_{gpu}.json", "transfer",
                 {"command": command, "peak": peak, "rows": all_rows, "tuning": tuning,
                  "best": {k: repr(v) for k, v in best.items()}})
    (out / f"transfer_{gpu}.txt").write_text(f"{command}\n{header}\n{table}\n")
    print(header + "\n" + table)


if __name__ == "__main__":
    raise SystemExit(main())
