"""kvtier's reference engine against a real CUDA vLLM: one script, one GPU, the same model and prompts.

Both engines run on the same machine, each case in a fresh process (``--case``), an
8B-shaped model (``--preset llama3-8b-shape``, random weights: vLLM ``load_format="dummy"``,
kvtier a seeded preset), bf16, seeded random prompts of ids 5..1000 (the same ids for both
engines where both run a prompt: ``vllm_gpu_case.prompt``). Cases:

- ``kernel``: the paged prefill kernel (``kvtier.engine.paged_triton``) against
  ``F.scaled_dot_product_attention`` (flash backend, causal, K/V repeated to every query head
  in contiguous tensors, so it reads no pages) on one layer's shape at each of
  ``--lengths``, TFLOP/s of the causal work (``4 * heads * head_dim * L(L+1)/2``), page
  sizes 64 and 16, a 32k prompt in the engine's 8192-token steps; then the numerics contract
  on the GPU: a prompt computed whole, in steps of several sizes and as a hit's suffix (the
  flash kernel and the split launch) must give bit-identical outputs (``bitwise`` rows);
- ``kvtier``: kvtier's engine in-process (``EngineService``, no HTTP): TTFT of recompute,
  device hit and host hit at ``--lengths`` (``kvtier.bench.ttft.TtftRun``: a prefix of L
  tokens plus a fresh 32-token suffix, kvtier off as the recompute, medians of
  ``--repeats``); then generated tokens/s for 16 and 64 concurrent ~4,980-token prompts with
  128 new tokens each, and the decode inter-token latency at batch 1 and 16;
- ``kvtier_det``: the same with ``engine.deterministic`` on (batch-invariant kernels in every
  forward: the mode whose hits are bit-identical to a recompute on the GPU), reported against
  ``kvtier`` (what exactness costs);
- ``vllm_main``: vLLM 0.26 (its default torch.compile + CUDA graphs, prefix caching on):
  recompute TTFT (prompts it has not seen), GPU prefix hit (same prefix, fresh 32-token
  suffix), the same throughput and inter-token latency runs;
- ``vllm_native``: vLLM with native CPU offloading (``kv_offloading_backend="native"``):
  store the prompt, reset the GPU prefix cache, time the host hit (same prefix, fresh suffix).

TTFT is wall time from submit to the first token (vLLM: ``LLM.generate`` with
``max_tokens=1``). Inter-token latency at batch B is ``(T(B prompts, 129 new) - T(B other
prompts, 1 new)) / 128``: the same difference on both engines, so prefill and launch costs
cancel. Throughput is generated tokens over the wall time of the whole batch. Ratios are
kvtier / vLLM; the goal column gives the target ratio (TTFT and latency: lower is better;
throughput: higher). The throughput runs give kvtier's page pool the GPU KV cache vLLM
sized for itself in the same run (``vllm_main``'s ``kv_tokens``: that case runs first; else
``--kvtier-device-fraction`` of free memory), at most that fraction of the memory free then
(vLLM's 412k tokens on an H100 left kvtier's engine too little for its workspaces: every
request failed for want of memory), and its prefill chunk vLLM's tokens per step
(``max_num_batched_tokens``: 16384 for ``LLM`` on an 80 GB GPU, twice kvtier's default): with
less room an engine serves 64 long prompts in waves, with smaller steps it runs more of them,
and the runs would compare settings, not engines. Both capacities, both step sizes and
kvtier's preemptions are in the table.

Run (vLLM from ``../shared/tools/vllm-gpu``'s kit, ``. /tmp/vg/env.sh`` first)::

    python3 benchmarks/engine/engine_vs_vllm.py --out /tmp/evv                 # every case
    python3 benchmarks/engine/engine_vs_vllm.py --out /tmp/evv --cases kernel,kvtier
    python3 benchmarks/engine/engine_vs_vllm.py --out /tmp/evv --kernel-only

Each case writes ``<out>/cases/<case>.json`` when it ends (a failed one records its error and
the tail of its output, and the run goes on); every run then prints the table over all case
files under ``--out`` (so cases may run in separate commands) and writes
``<out>/engine_vs_vllm.json`` (machine, settings, cases, table) and ``<out>/cases.log`` (every
child's output).

Modules (this folder): ``engine_vs_vllm_measure.py`` (the helpers and prompts kvtier's and
vLLM's cases share), ``engine_vs_vllm_kernel.py`` (the ``kernel`` case),
``engine_vs_vllm_kvtier.py`` (kvtier's cases), ``engine_vs_vllm_vllm.py`` (vLLM's cases),
``engine_vs_vllm_report.py`` (the table and the report); this script keeps the command line,
the parent that runs each case as a child of this script, and the child's entry point.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm"))    # vllm_gpu, vllm_gpu_case
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))   # batching_gpu (another folder)

import vllm_gpu
import vllm_gpu_case
from engine_vs_vllm_kernel import kernel_case
from engine_vs_vllm_kvtier import kvtier_case
from engine_vs_vllm_report import gpu_names, load_cases, sub_errors, table
from engine_vs_vllm_vllm import vllm_case
from vllm_gpu_case import emit, log

CASES = ("kernel", "kvtier", "kvtier_det", "vllm_main", "vllm_native")


# ================================================================================================
# child and parent
# ================================================================================================
def child_main(args: argparse.Namespace) -> None:
    res: dict[str, Any] = {"case": args.case, "ok": False}
    code = 0
    try:
        if args.case == "kernel":
            res.update(kernel_case(args))
        elif args.case in ("kvtier", "kvtier_det"):
            res.update(kvtier_case(args, deterministic=args.case == "kvtier_det"))
        else:
            res.update(vllm_case(args, args.case))
        res["ok"] = True
    except BaseException as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        print(traceback.format_exc()[-6000:], flush=True)
        code = 1
    emit("RESULT", **res)
    sys.stdout.flush()
    os._exit(code)           # skip interpreter teardown (engine threads can hang it)


def run_case(args: argparse.Namespace, case: str, timeout_s: float, logf: Any) -> dict[str, Any]:
    """One case in a fresh process; a partial result (``@@PARTIAL``) survives a crash or kill."""
    partial: dict[str, Any] = {}
    done = vllm_gpu.run_child(args, case, "graphs", timeout_s, logf, script=__file__)
    logf.flush()
    log_text = (Path(args.out) / "cases.log").read_text(errors="replace")
    for line in log_text.split(f"===== {case} / graphs =====")[-1].splitlines():
        if line.startswith("@@PARTIAL "):
            partial = json.loads(line[len("@@PARTIAL "):])
    if not done.get("ok"):
        done = {**partial, **done, "partial": bool(partial)}
    done["case"] = case
    return done


def _vllm_sizes(out: Path) -> tuple[int, int]:
    """The GPU KV cache (tokens) vLLM sized for itself in this run's vllm_main case and its
    tokens per step, or zeros."""
    try:
        main = json.loads((out / "cases" / "vllm_main.json").read_text())
    except (OSError, ValueError):
        return 0, 0
    return int(main.get("kv_tokens") or 0), int(main.get("step_tokens") or 0)


def parent_main(args: argparse.Namespace) -> None:
    from kvtier.machine import write_report

    out = Path(args.out)
    (out / "cases").mkdir(parents=True, exist_ok=True)
    if any(c.startswith("vllm") for c in args.cases):
        vllm_gpu.build_model_dir(args.preset, Path(args.model_dir))
    deadline = time.monotonic() + args.budget_s
    cases_in_order = list(args.cases)
    if (args.kvtier_kv_tokens < 0 or args.kvtier_step_tokens < 0) \
            and "vllm_main" in cases_in_order:                          # its sizes first
        cases_in_order.sort(key=lambda c: c != "vllm_main")
    matched = False
    with open(out / "cases.log", "a") as logf:
        for case in cases_in_order:
            left = deadline - time.monotonic()
            if left < 30:
                result: dict[str, Any] = {"case": case, "ok": False, "error": "no time left"}
            else:
                log(f"case {case} ({left:.0f} s left)")
                vllm_kv, vllm_step = _vllm_sizes(out) if case.startswith("kvtier") \
                    and not matched and "vllm_main" in args.cases else (0, 0)
                if vllm_kv and args.kvtier_kv_tokens < 0:   # the same KV capacity as vLLM's:
                    args.child_argv += ["--kvtier-kv-tokens", str(vllm_kv)]   # engines, not pools
                if vllm_step and args.kvtier_step_tokens < 0:   # and the same step budget
                    args.child_argv += ["--kvtier-step-tokens", str(vllm_step)]
                matched = matched or bool(vllm_kv or vllm_step)
                result = run_case(args, case, min(left, args.case_timeout_s), logf)
                logf.flush()
            if not result.get("ok"):
                log(f"case {case} FAILED: {result.get('error')}")
            (out / "cases" / f"{case}.json").write_text(
                json.dumps(result, indent=1, default=str) + "\n")
    cases = load_cases(out)
    text, rows = table(args, cases)
    gpus = gpu_names()
    header = (f"engine_vs_vllm on {gpus}: {args.preset}, {args.dtype}, random weights; kvtier/vLLM "
              f"< 1 means kvtier is faster for times, slower for tok/s. Cases: "
              + ", ".join(f"{c}={'ok' if d.get('ok') else 'FAILED: ' + str(d.get('error'))[:120]}"
                          for c, d in cases.items()))
    for c, d in cases.items():
        if d.get("prefill_attention"):
            header += f"\n  {c}: prompt attention {d['prefill_attention']}"
        for where, message in sub_errors(d):
            header += f"\n  {c}: {where} failed: {message[:200]}"
    print("\n" + header + "\n\n" + text)
    (out / "engine_vs_vllm.txt").write_text(header + "\n\n" + text + "\n")
    write_report(out / "engine_vs_vllm.json", "engine_vs_vllm", {
        "gpu": gpus,
        "settings": {k: v for k, v in vars(args).items() if k != "child_argv"},
        "table": rows, "cases": cases})
    print(f"wrote {out / 'engine_vs_vllm.json'} and {out / 'engine_vs_vllm.txt'}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="results directory")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--kernel-only", action="store_true", help="only the kernel micro-benchmark")
    p.add_argument("--case", choices=CASES, help="(internal) run one case in this process")
    p.add_argument("--mode", default="graphs", help="(internal)")
    p.add_argument("--preset", default="llama3-8b-shape")
    p.add_argument("--model-dir", default="/tmp/kvtier_evv_model")
    p.add_argument("--lengths", default="4096,32768")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--levels", default="16,64", help="concurrent prompts of the throughput runs")
    p.add_argument("--throughput-prompt", type=int, default=vllm_gpu_case.THROUGHPUT_PROMPT,
                   help="prompt tokens of the throughput runs")
    p.add_argument("--device", default="cuda", help="kvtier's device (cpu: a dry run of the script)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--itl-prompt", type=int, default=2048, help="prompt tokens of the ITL runs")
    p.add_argument("--itl-repeats", type=int, default=2)
    p.add_argument("--offload-gib", type=float, default=12.0,
                   help="vLLM's native CPU offloading and kvtier's host tier")
    p.add_argument("--vllm-block-size", type=int, default=16,
                   help="vLLM's KV block (16 on CUDA; its CPU build needs a multiple of 32)")
    p.add_argument("--vllm-gpu-mem", type=float, default=0.85,
                   help="vLLM gpu_memory_utilization (weights + activations + KV)")
    p.add_argument("--kvtier-device-fraction", type=float, default=0.75,
                   help="kvtier's page pool share of the free device memory (throughput runs), "
                        "when its KV capacity is not vLLM's (--kvtier-kv-tokens), and the most "
                        "it takes when it is")
    p.add_argument("--kvtier-kv-tokens", type=int, default=-1,
                   help="KV tokens of kvtier's page pool in the throughput runs: -1 (default) "
                        "the GPU KV cache vLLM sized for itself in this run's vllm_main case "
                        "(run first then; else --kvtier-device-fraction), 0 the fraction, "
                        "N that many")
    p.add_argument("--kvtier-step-tokens", type=int, default=-1,
                   help="kvtier's prefill chunk (engine.prefill_chunk_tokens) in the throughput "
                        "runs: -1 (default) vLLM's tokens per step in this run's vllm_main case "
                        "(its max_num_batched_tokens), 0 kvtier's own, N that many")
    p.add_argument("--kvtier-ttft-fraction", type=float, default=0.3,
                   help="each of the two TTFT services' page pool share (kvtier bench ttft's)")
    p.add_argument("--kvtier-set", default="",
                   help="kvtier config settings beside the script's, KEY=VALUE,... (e.g. "
                        "host.copy_path=copy_engine,host.load_programs=0): a variant's run")
    p.add_argument("--kvtier-tma", action="store_true",
                   help="kvtier's paged prefill reads pages through tensor descriptors on the "
                        "GPU (paged_triton.GPU_DESCRIPTORS)")
    p.add_argument("--budget-s", type=float, default=540.0, help="all cases of this run")
    p.add_argument("--case-timeout-s", type=float, default=330.0)
    args = p.parse_args(argv)
    args.child_argv = [a for a in argv if a != "--kernel-only"]
    args.lengths = [int(x) for x in str(args.lengths).split(",") if x]
    args.levels = [int(x) for x in str(args.levels).split(",") if x]
    try:
        args.kvtier_set = dict(item.split("=", 1) for item in str(args.kvtier_set).split(",")
                               if item)
    except ValueError:
        p.error(f"--kvtier-set wants KEY=VALUE,...; got {args.kvtier_set!r}")
    args.cases = ["kernel"] if args.kernel_only else \
        [c for c in str(args.cases).split(",") if c]
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        p.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    return args


def main() -> None:
    args = parse_args(sys.argv[1:])
    if args.case:
        child_main(args)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
