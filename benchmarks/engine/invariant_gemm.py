"""The deterministic mode's matmul (``kvtier.engine.invariant_gemm``) against cuBLAS and the old kernel.

For llama3-8b's linear shapes in bf16 (qkv 4096->6144, o 4096->4096, gate_up 4096->28672,
down 14336->4096) and row counts M from decode (1, 16, 64) to prefill (256, 4096, 32768), it
times ``torch.mm`` (cuBLAS), the 64 x 64 x 64 kernel the mode ran before
(``invariant_gemm_old.py``) and the new kernel: median ms of several repeats, each a CUDA graph
of enough calls to run about ``--target-ms`` (so that launch costs do not count, as in the
engine's captured decode), the calls rotating over copies of the weight that together exceed
the L2 cache. It reports TFLOP/s, the weight's GB/s and the ratios, and which launch the new
kernel took (fused or split over the inner segments).

Then the contract on the GPU, per shape: rows computed in batches of 1, 7, 64 and 4096 rows
(and the first 4096 rows forced through the split launch) must be bit-identical to the same
rows inside the largest batch; the same check for cuBLAS and the old kernel for contrast. Last,
a few variants of the new kernel (pipeline depths; a 128 x 256 tile for wide weights), timed
and their bits checked.

One GPU, torch + triton + kvtier (``PYTHONPATH=src``), under 4 minutes on an H100:
``python3 benchmarks/engine/invariant_gemm.py --out DIR``. ``--smoke``: tiny shapes in the
Triton interpreter on the CPU, to check the script end to end. Prints the tables and writes
``DIR/invariant_gemm.json`` (with the machine's facts) and ``DIR/invariant_gemm.txt``. Main
thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
          ("down", 4096, 14336))
ROWS = (1, 16, 64, 256, 4096, 32768)
SMOKE_SHAPES = (("qkv", 48, 600), ("down", 40, 136))
SMOKE_ROWS = (1, 7, 33)
#: Weight copies the timed calls rotate over: at least this many bytes, beyond an H100's or
#: H200's 50 MB L2, so that decode reads its weights from memory as the engine does.
ROTATE_BYTES = 200 << 20
#: (first row, rows) batches checked against the largest batch; ``LAST`` is its last row.
LAST = -1
CHECKS = ((0, 1), (LAST, 1), (4093, 7), (129, 64), (1000, 4096))
SMOKE_CHECKS = ((0, 1), (LAST, 1), (3, 7), (5, 33))
IMPLS = ("cublas", "old", "new")
#: Bound on what one graph's calls allocate (each call's output stays in the graph's pool).
GRAPH_BYTES = 4 << 30


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="folder for invariant_gemm.json/.txt")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes in the Triton interpreter on the CPU")
    parser.add_argument("--rows", default="",
                        help="comma-separated row counts (default 1,16,64,256,4096,32768)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--target-ms", type=float, default=3.0,
                        help="GPU time of one timed repeat (calls per graph follow)")
    parser.add_argument("--budget-s", type=float, default=170.0,
                        help="skip the 32768-row cases once this much time has passed")
    parser.add_argument("--variant-rows", type=int, default=4096)
    return parser.parse_args(argv)


class Bench:
    """What every measurement needs: the device, the kernels, the clock and the log."""

    def __init__(self, args: argparse.Namespace) -> None:
        # the interpreter is chosen before triton and the kernels are imported
        if args.smoke:
            os.environ["TRITON_INTERPRET"] = "1"
        elif not torch.cuda.is_available():
            raise SystemExit("invariant_gemm: no CUDA device (use --smoke on the CPU)")
        from invariant_gemm_old import old_matmul
        from kvtier.engine import invariant_gemm

        self.gemm = invariant_gemm
        self.args = args
        self.device = torch.device("cpu" if args.smoke else "cuda")
        self.started = time.perf_counter()
        self.lines: list[str] = []
        # every weight is stored as the engine stores it, (N, K); torch.mm takes its .T view
        self.impls: dict[str, Callable[[Any, Any], Any]] = {
            "cublas": lambda x, w: torch.mm(x, w.T),
            "old": lambda x, w: old_matmul(x, w, None),
            "new": lambda x, w: invariant_gemm.matmul(x, w, None),
        }

    def log(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.started:6.1f}s] {text}", flush=True)

    def emit(self, text: str) -> None:
        print(text, flush=True)
        self.lines.append(text)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def time_ms(self, fn: Callable[[int], Any]) -> tuple[float, str]:
        """Median ms a call of ``fn(i)`` (i picks the weight copy) and how it was timed."""
        if self.device.type != "cuda":
            fn(0)
            begin = time.perf_counter()
            fn(1)
            return (time.perf_counter() - begin) * 1e3, "cpu"
        for i in range(3):
            fn(i)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn(0)
        end.record()
        end.synchronize()
        per_call = max(torch.cuda.max_memory_allocated() - held, 1)   # outputs a graph keeps
        calls = max(1, min(200, GRAPH_BYTES // per_call,
                           math.ceil(self.args.target_ms / max(begin.elapsed_time(end), 1e-3))))
        graph: Any = None
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn(0)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for i in range(calls):
                    fn(i)
            how = "graph"
        except Exception as exc:   # timed eagerly then, and said so in the results
            graph, how = None, f"eager ({type(exc).__name__})"
        times = []
        for _ in range(self.args.repeats):
            begin.record()
            if graph is not None:
                graph.replay()
            else:
                for i in range(calls):
                    fn(i)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / calls)
        del graph
        torch.cuda.empty_cache()
        return statistics.median(times), how


def _fmt(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def timings(bench: Bench, shapes: tuple[tuple[str, int, int], ...], rows: list[int],
            gen: torch.Generator) -> list[dict[str, Any]]:
    """Every (shape, M, implementation): ms, TFLOP/s, GB/s of the weight."""
    results: list[dict[str, Any]] = []
    dev, dtype = bench.device, torch.bfloat16
    for name, n, k in shapes:
        weight = torch.randn((n, k), generator=gen, device=dev, dtype=dtype) * k ** -0.5
        extra = math.ceil(ROTATE_BYTES / weight.nbytes) - 1 if dev.type == "cuda" else 0
        copies = [weight] + [weight.clone() for _ in range(extra)]
        for m in rows:
            if m >= 32768 and bench.elapsed() > bench.args.budget_s:
                bench.log(f"{name} M={m}: skipped (past --budget-s)")
                continue
            need = (m * k + 4 * m * n) * 2 + 4 * m * n * 4
            if dev.type == "cuda" and need > torch.cuda.mem_get_info()[0] * 0.7:
                bench.log(f"{name} M={m}: skipped (memory)")
                continue
            x = torch.randn((m, k), generator=gen, device=dev, dtype=dtype)
            tiles = bench.gemm.tiles_for(dtype, n, k)
            launch = "split" if bench.gemm.splits(m, n, tiles, dev) else "fused"
            for impl in IMPLS:
                fn = bench.impls[impl]
                ms, how = bench.time_ms(lambda i, fn=fn, x=x, c=copies: fn(x, c[i % len(c)]))
                flop = 2.0 * m * n * k
                results.append({"shape": name, "n": n, "k": k, "m": m, "impl": impl,
                                "ms": ms, "tflops": flop / ms / 1e9,
                                "weight_gbps": weight.nbytes / ms / 1e6, "timing": how,
                                "launch": launch if impl == "new" else None})
                bench.log(f"{name} M={m} {impl}: {ms:.4g} ms ({how})")
            del x
        del copies, weight
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return results


def timing_table(results: list[dict[str, Any]]) -> list[str]:
    by = {(r["shape"], r["m"], r["impl"]): r for r in results}
    head = ("shape", "M", "cuBLAS ms", "old ms", "new ms", "new TFLOP/s", "new GB/s",
            "new/cuBLAS", "old/new", "launch")
    rows = []
    for shape, m in dict.fromkeys((r["shape"], r["m"]) for r in results):
        c, o, n = (by[(shape, m, i)] for i in IMPLS)
        rows.append((shape, str(m), _fmt(c["ms"]), _fmt(o["ms"]), _fmt(n["ms"]),
                     _fmt(n["tflops"]), _fmt(n["weight_gbps"]), f"{n['ms'] / c['ms']:.2f}",
                     f"{o['ms'] / n['ms']:.2f}", n["launch"]))
    return _table(head, rows)


def _table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    return lines + ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]


def invariance(bench: Bench, shapes: tuple[tuple[str, int, int], ...], largest: int,
               checks: tuple[tuple[int, int], ...], gen: torch.Generator) -> list[dict[str, Any]]:
    """Per shape and implementation: do rows of smaller batches equal the largest batch's?"""
    results: list[dict[str, Any]] = []
    dev, dtype = bench.device, torch.bfloat16
    for name, n, k in shapes:
        weight = torch.randn((n, k), generator=gen, device=dev, dtype=dtype) * k ** -0.5
        x = torch.randn((largest, k), generator=gen, device=dev, dtype=dtype)
        for impl in IMPLS:
            fn = bench.impls[impl]
            whole = fn(x, weight)
            batches: dict[str, bool] = {}
            differing = 0
            for first, count in checks:
                first = largest - 1 if first == LAST else first
                if first + count > largest:
                    continue
                got = fn(x[first:first + count], weight)
                same = got == whole[first:first + count]
                batches[f"{count}@{first}"] = bool(same.all())
                differing += int((~same).any(dim=1).sum())
            if impl == "new":   # the split launch on many rows, against the fused launch
                count = min(4096, largest)
                forced = bench.gemm.matmul(x[:count], weight, None, split=True)
                same = forced == whole[:count]
                batches[f"{count}@0 split"] = bool(same.all())
                differing += int((~same).any(dim=1).sum())
            results.append({"shape": name, "impl": impl, "largest": largest,
                            "identical": all(batches.values()), "batches": batches,
                            "differing_rows": differing})
            bench.log(f"invariance {name} {impl}: {all(batches.values())}")
            del whole
        del x, weight
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return results


def invariance_table(results: list[dict[str, Any]]) -> list[str]:
    by = {(r["shape"], r["impl"]): r for r in results}
    rows = [(shape, *(f"{by[(shape, i)]['identical']} ({by[(shape, i)]['differing_rows']})"
                      for i in IMPLS))
            for shape in dict.fromkeys(r["shape"] for r in results)]
    return _table(("shape", "cuBLAS", "old", "new"), rows)


def variants(bench: Bench, shapes: tuple[tuple[str, int, int], ...], m: int,
             gen: torch.Generator) -> list[dict[str, Any]]:
    """The new kernel's launch settings around the default, timed at ``m`` rows (fused) or
    16 (split), each output's rows checked against a reference's (the first rows of one
    input): pipeline depths and the split launch against the default fused launch (they must
    match); a 128 x 256 tile (one accumulator, so one segment: a candidate for wide weights,
    whose decode fills the GPU without the split launch) against itself at ``m`` rows, as
    another tile is another sum."""
    results: list[dict[str, Any]] = []
    dev, dtype, gemm = bench.device, torch.bfloat16, bench.gemm
    for name, n, k in shapes:
        weight = torch.randn((n, k), generator=gen, device=dev, dtype=dtype) * k ** -0.5
        x = torch.randn((m, k), generator=gen, device=dev, dtype=dtype)
        base = gemm.tiles_for(dtype, n, k)
        step = 16 if bench.args.smoke else base.k   # the interpreter's tensors stay < 2**20
        wide = dataclasses.replace(base, n=256, k=step, segments=1, seg_steps=math.ceil(k / step),
                                   stages=3)
        cases = (("default fused", "default", base, False, m),
                 ("fused stages 3", "default", dataclasses.replace(base, stages=3), False, m),
                 ("default split", "default", base, True, 16),
                 ("split stages 2", "default", dataclasses.replace(base, split_stages=2), True,
                  16),
                 ("split stages 4", "default", dataclasses.replace(base, split_stages=4), True,
                  16),
                 ("128x256 one segment", "128x256", wide, False, m),
                 ("128x256 one segment", "128x256", wide, False, 1))
        reference: dict[str, Any] = {}
        for label, family, tiles, split, rows in cases:
            rows = min(rows, m)
            part = x[:rows]
            out = gemm.matmul(part, weight, None, tiles=tiles, split=split)
            reference.setdefault(family, out)
            ms, how = bench.time_ms(lambda i, x=part, w=weight, tiles=tiles, split=split:
                                    gemm.matmul(x, w, None, tiles=tiles, split=split))
            results.append({"shape": name, "variant": label, "m": rows, "ms": ms,
                            "tflops": 2.0 * rows * n * k / ms / 1e9, "timing": how,
                            "reference": f"{family} M={m}",
                            "same_bits": bool(torch.equal(out, reference[family][:rows]))})
            bench.log(f"variant {name} {label} M={rows}: {ms:.4g} ms")
        del weight, x
    return results


def variant_table(results: list[dict[str, Any]]) -> list[str]:
    rows = [(r["shape"], r["variant"], str(r["m"]), _fmt(r["ms"]), _fmt(r["tflops"]),
             r["reference"], str(r["same_bits"])) for r in results]
    return _table(("shape", "variant", "M", "ms", "TFLOP/s", "bits of", "same bits"), rows)


def device_facts(bench: Bench) -> dict[str, Any]:
    import triton

    facts: dict[str, Any] = {"triton": triton.__version__, "torch": torch.__version__,
                             "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                             "interpreter": bench.args.smoke}
    if bench.device.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        facts.update(gpu=props.name, sms=props.multi_processor_count,
                     capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
    return facts


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    # this checkout's kvtier, also without PYTHONPATH=src
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    bench = Bench(args)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    rows = ([int(r) for r in args.rows.split(",")] if args.rows
            else list(SMOKE_ROWS if args.smoke else ROWS))
    gen = torch.Generator(device=bench.device).manual_seed(0)
    facts = device_facts(bench)
    bench.log(f"invariant_gemm on {facts.get('gpu', 'cpu (interpreter)')}, "
              f"torch {facts['torch']}, triton {facts['triton']}")
    tiles = {name: dataclasses.asdict(bench.gemm.tiles_for(torch.bfloat16, n, k))
             for name, n, k in shapes}

    timed = timings(bench, shapes, rows, gen)
    if args.smoke:
        largest = 40
    elif (bench.elapsed() <= args.budget_s
          and torch.cuda.get_device_properties(0).total_memory >= 60e9):
        largest = 32768
    else:
        largest = 8192    # room for the batch of 4096 rows from row 1000
    bench.log(f"invariance against batches of {largest} rows")
    checked = invariance(bench, shapes, largest, SMOKE_CHECKS if args.smoke else CHECKS, gen)
    varied = variants(bench, shapes, 16 if args.smoke else args.variant_rows, gen)

    title = (f"invariant_gemm: {facts.get('gpu', 'cpu, Triton interpreter (smoke)')}, bf16, "
             f"torch {facts['torch']}, triton {facts['triton']}, {facts['date_utc']}")
    bench.emit(title)
    bench.emit("\ntimes: median ms a call (CUDA graphs of calls rotating over weight copies)")
    for line in timing_table(timed):
        bench.emit(line)
    checks = SMOKE_CHECKS if args.smoke else CHECKS
    sizes = ", ".join(str(c) for c in dict.fromkeys(c for _, c in checks))
    bench.emit(f"\nrow invariance: rows of batches of {sizes} (first and last row for 1) and "
               f"{min(4096, largest)} rows through the split launch, bit-identical to the same "
               f"rows in a batch of {largest}? (rows that differ)")
    for line in invariance_table(checked):
        bench.emit(line)
    bench.emit("\nvariants of the new kernel (same bits: rows equal to the reference's)")
    for line in variant_table(varied):
        bench.emit(line)
    bench.emit(f"\ntiles: {tiles}")
    bench.log("done")
    if args.out:
        from kvtier.machine import write_report

        out = Path(args.out)
        write_report(out / "invariant_gemm.json", "invariant_gemm",
                     {"device": facts, "args": vars(args), "tiles": tiles, "timings": timed,
                      "invariance": checked, "variants": varied})
        (out / "invariant_gemm.txt").write_text("\n".join(bench.lines) + "\n")
        print(f"wrote {out / 'invariant_gemm.json'} and {out / 'invariant_gemm.txt'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
