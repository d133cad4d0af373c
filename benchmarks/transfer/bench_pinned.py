"""Pinned host memory: allocation cost, budget accounting against the driver, copy rates.

Compares, side by side in one run:

1. allocation: kvtier's registered buffers (``allocate_host_bytes``: aligned allocation +
   ``cudaHostRegister``) against torch's pinned allocator (``pin_memory=True``) and pageable
   memory, for pool-sized buffers, with the bytes torch's allocator really pins;
2. per-page cost: pinning one page per read (what the read ring avoids) against borrowing a ring
   slot;
3. accounting: pool + ring under a real budget, a refused reservation, and three create/close
   cycles, with the process's locked/pinned memory from /proc;
4. copy rate host->device and device->host from registered, torch-pinned and pageable memory.

Without CUDA only the host-side parts run. Writes ``pinned_gpu.json`` (``pinned_cpu.json``)
and a ``.txt`` table under --out.
Run: ``PYTHONPATH=src python benchmarks/transfer/bench_pinned.py --out benchmarks/results``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from kvtier.errors import PinnedBudgetExceeded
from kvtier.layout import KVLayout
from kvtier.machine import format_table, write_report
from kvtier.memory import HostPool, PinnedBudget, ReadRing, allocate_host_bytes
from kvtier.memory.host_bytes import aligned_empty

MIB = 1 << 20
CUDA = torch.cuda.is_available()


def _timed(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _torch_pinned_bytes() -> int:
    if not CUDA:
        return 0
    return int(torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0))


def _proc_status(*names: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in names:
            out[key] = int(line.split()[1]) * 1024
    return out


def bench_alloc(sizes_mib: list[int]) -> list[dict[str, Any]]:
    """Allocate+free pool-sized buffers three ways; pinned bytes as torch really holds them."""
    rows = []
    budget = PinnedBudget(1 << 40)
    if CUDA:
        torch.zeros(1, device="cuda")  # start the CUDA context outside the timed region
    for mib in sizes_mib:
        n = mib * MIB
        t_reg, host = _timed(lambda n=n: allocate_host_bytes(budget, "bench", n))
        t_reg_free, _ = _timed(host.close)
        t_page, buf = _timed(lambda n=n: aligned_empty(n)[1].fill_(0))
        del buf
        row = {"mib": mib, "registered_alloc_s": t_reg, "registered_free_s": t_reg_free,
               "registered_pinned_bytes": n if host.method == "registered" else None,
               "method": host.method, "pageable_alloc_touch_s": t_page}
        if CUDA:
            before = _torch_pinned_bytes()
            t_torch, pinned = _timed(lambda n=n: torch.empty(n, dtype=torch.uint8, pin_memory=True))
            row["torch_pinned_alloc_s"] = t_torch
            row["torch_pinned_bytes"] = _torch_pinned_bytes() - before
            del pinned
            row["torch_pinned_bytes_after_free"] = _torch_pinned_bytes() - before
        rows.append(row)
    return rows


def bench_per_page(page_bytes: int, count: int) -> dict[str, Any]:
    """Microseconds per page: a fresh (pinned when CUDA) buffer per read vs a ring slot."""
    budget = PinnedBudget(1 << 40)
    t_fresh, _ = _timed(lambda: [allocate_host_bytes(budget, "per_page", page_bytes).close()
                                 for _ in range(count)])
    ring = ReadRing(4, page_bytes, budget)

    def borrow_all() -> None:
        for _ in range(count):
            with ring.borrow():
                pass

    t_ring, _ = _timed(borrow_all)
    ring.close()
    return {"page_bytes": page_bytes, "pages": count, "fresh_buffer_us": t_fresh / count * 1e6,
            "ring_borrow_us": t_ring / count * 1e6, "fresh_pinned": CUDA}


def bench_accounting(layout: KVLayout, pool_pages: int, ring_slots: int) -> dict[str, Any]:
    """Pool + ring at the budget; one refusal; three lifetimes back to the start."""
    ring_bytes = ring_slots * -(-layout.page_bytes // 4096) * 4096
    budget = PinnedBudget(pool_pages * layout.page_bytes + ring_bytes)
    start = _proc_status("VmLck", "VmPin", "VmRSS")
    cycles = []
    for _ in range(3):
        pool = HostPool(layout, pool_pages, budget)
        ring = ReadRing(ring_slots, layout.page_bytes, budget)
        during = _proc_status("VmLck", "VmPin", "VmRSS")
        refused = None
        try:
            allocate_host_bytes(budget, "staging", 4096)
        except PinnedBudgetExceeded as exc:
            refused = str(exc)
        held, method = budget.held_bytes, pool.pin_method
        ring.close()
        pool.close()
        cycles.append({"held_bytes": held, "refusal": refused, "proc_during": during,
                       "held_after_close": budget.held_bytes, "pin_method": method})
    return {"pool_bytes": pool_pages * layout.page_bytes, "ring_bytes": ring_bytes,
            "limit_bytes": budget.limit_bytes, "proc_start": start, "cycles": cycles,
            "proc_end": _proc_status("VmLck", "VmPin", "VmRSS"), "budget": budget.stats()}


def _copy_rate(src: torch.Tensor, dst: torch.Tensor, repeats: int) -> float:
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return src.numel() * repeats / (start.elapsed_time(end) / 1e3)


def bench_copy(nbytes: int, repeats: int) -> list[dict[str, Any]]:
    """GB/s host->device and device->host from three kinds of host memory."""
    budget = PinnedBudget(1 << 40)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    kinds = {"registered": allocate_host_bytes(budget, "copy", nbytes),
             "torch_pinned": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
             "pageable": aligned_empty(nbytes)[1]}
    rows = []
    for name, host in kinds.items():
        tensor = host.tensor if hasattr(host, "tensor") else host
        tensor.fill_(1)
        # is_pinned() answers False for registered memory; HostBytes.pinned is the truth.
        pinned = host.pinned if hasattr(host, "pinned") else bool(tensor.is_pinned())
        rows.append({"memory": name, "bytes": nbytes, "pinned": pinned,
                     "h2d_gbps": _copy_rate(tensor, device, repeats) / 1e9,
                     "d2h_gbps": _copy_rate(device, tensor, repeats) / 1e9})
    kinds["registered"].close()
    return rows


def tables(report: dict[str, Any]) -> str:
    parts = ["allocation (seconds; bytes torch really pins)",
             format_table(["MiB", "method", "reg alloc", "reg free", "pageable+touch",
                           "torch pin alloc", "torch pinned B", "after free B"],
                          [[r["mib"], r["method"], r["registered_alloc_s"], r["registered_free_s"],
                            r["pageable_alloc_touch_s"], r.get("torch_pinned_alloc_s", "-"),
                            r.get("torch_pinned_bytes", "-"),
                            r.get("torch_pinned_bytes_after_free", "-")]
                           for r in report["alloc"]])]
    parts += ["per-page buffers (microseconds per page)",
              format_table(["page B", "fresh buffer us", "ring borrow us"],
                           [[r["page_bytes"], r["fresh_buffer_us"], r["ring_borrow_us"]]
                            for r in report["per_page"]])]
    acc = report["accounting"]
    parts.append("accounting: " + ", ".join(
        f"cycle {i}: held {c['held_bytes']} -> {c['held_after_close']}, refused: "
        f"{c['refusal'] is not None}" for i, c in enumerate(acc["cycles"])))
    if report.get("copy"):
        parts += ["copy rate (GB/s)", format_table(
            ["memory", "pinned", "MiB", "h2d", "d2h"],
            [[r["memory"], r["pinned"], r["bytes"] // MIB, r["h2d_gbps"], r["d2h_gbps"]]
             for r in report["copy"]])]
    return "\n\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--sizes-mib", default="64,600,1024" if CUDA else "16,64")
    parser.add_argument("--copy-mib", type=int, default=256)
    args = parser.parse_args()
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)
    report: dict[str, Any] = {
        "cuda": CUDA,
        "alloc": bench_alloc([int(s) for s in args.sizes_mib.split(",")]),
        "per_page": [bench_per_page(n, 50 if CUDA else 200) for n in (64 * 1024, 2 * MIB)],
        "accounting": bench_accounting(layout, 64, 8),
        "copy": bench_copy(args.copy_mib * MIB, 10) if CUDA else [],
    }
    text = tables(report)
    print(text)
    stem = Path(args.out) / f"pinned_{'gpu' if CUDA else 'cpu'}"
    write_report(stem.with_suffix(".json"), "pinned", report)
    stem.with_suffix(".txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
