"""The connector's CPU cost of one save inside vLLM's step, with and without host-only saves.

A finished request (``--prompt-pages`` full pages of prompt, ``--output-pages`` of output)
whose prompt kvtier holds on its host tier but no longer on its device tier (its staging pages
were taken by other requests since its prefill, as on a busy server) is saved the way the
connector saves on CUDA (``WorkerSide(copy_in_step=True)``: plan, per-layer copies and commit in
``wait_for_save``), here on CPU tensors, through vLLM's real scheduler half and kvtier's real
``TieredCache`` (the vLLM test suite's harness: no model runs). Two cases, each in its own
connector: ``whole`` (``SaveCopier.tail_saves`` off: the prompt is copied and committed again
through the device tier) and ``tail`` (on: only the new pages, straight to host,
``TieredCache.commit_tail``). Reported per case, the median over ``--saves`` saves after
``--warmup``: the connector's counters ``save_plan_cpu_us``, ``save_copy_cpu_us``,
``save_commit_cpu_us``, the hook's thread CPU time and the tokens copied. The copies' cost is the
CPU path's (a copy per block); on a GPU they are one kernel launch per layer whatever their size,
so read the plan and commit columns for what carries over.

    .venv-vllm/bin/python benchmarks/vllm/vllm_save_cpu.py --out DIR

writes ``vllm_save_cpu.json`` (with machine info) and ``vllm_save_cpu.txt``. Main thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests" / "vllm_suite"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from save_harness import BLOCK, make_worker, prompt_ids, saver_scheduler  # noqa: E402
from scheduler_harness import fill_kvtier  # noqa: E402
from vllm_helpers import build_model  # noqa: E402

from kvtier.machine import format_table, write_report  # noqa: E402

COUNTERS = ("save_plan_cpu_us", "save_copy_cpu_us", "save_commit_cpu_us", "saved_tokens",
            "saves_to_host_only")


def run_case(model: Path, tmp: Path, tail: bool, args: argparse.Namespace) -> dict[str, Any]:
    from kvtier.integrations.vllm.saves import SaveCopier
    from kvtier.integrations.vllm.scheduler import KvtierConnectorMetadata, SaveSpec

    pages = args.prompt_pages + args.output_pages
    sched = saver_scheduler(model, tmp, staging_pages=2 * pages,
                            host_pool_bytes=f"{args.host_mib}MiB")
    runtime = sched.connector.runtime
    try:
        worker = make_worker(runtime, copy_in_step=True)
        for part in vars(worker).values():
            if isinstance(part, SaveCopier):
                part.tail_saves = tail and part.tail_saves
        page = runtime.page_size
        if pages * page // BLOCK > 255:
            raise SystemExit(f"{pages} pages of {page} tokens do not fit the harness's 256 blocks")
        samples: list[dict[str, int]] = []
        for i in range(args.warmup + args.saves):
            prompt = [t + 1000 * i for t in prompt_ids(args.prompt_pages * page, 1000)]
            fill_kvtier(runtime, prompt)
            with runtime.lock:
                runtime.cache.clear_tier("device")
            tokens = prompt + [7 + i] * (args.output_pages * page)
            before = {name: runtime.counts[name] for name in COUNTERS}
            spec = SaveSpec(f"r{i}", tuple(tokens), None, tuple(range(1, pages * page // BLOCK + 1)))
            started = time.thread_time()
            worker.wait_for_save(KvtierConnectorMetadata(saves=[spec]))
            hook_us = int((time.thread_time() - started) * 1e6)
            with runtime.lock:
                runtime.cache.drain(10.0)
            if i >= args.warmup:
                samples.append({**{n: runtime.counts[n] - before[n] for n in COUNTERS},
                                "hook_cpu_us": hook_us})
        return {name: statistics.median(s[name] for s in samples) for name in samples[0]}
    finally:
        runtime.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".")
    p.add_argument("--prompt-pages", type=int, default=136, help="prompt pages held on host")
    p.add_argument("--output-pages", type=int, default=2, help="new pages the save adds")
    p.add_argument("--saves", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--host-mib", type=int, default=512)
    args = p.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model")
        for case, tail in (("whole", False), ("tail", True)):
            case_dir = Path(tmp) / case
            case_dir.mkdir()
            results[case] = run_case(model, case_dir, tail, args)
    headers = ["case", "plan us", "copy us", "commit us", "hook CPU us", "tokens copied",
               "to host only"]
    rows = [[case, r["save_plan_cpu_us"], r["save_copy_cpu_us"], r["save_commit_cpu_us"],
             r["hook_cpu_us"], r["saved_tokens"], r["saves_to_host_only"]]
            for case, r in results.items()]
    table = (f"one finished request's save in vLLM's step (CPU tensors), {args.prompt_pages} "
             f"prompt pages on host only + {args.output_pages} new pages, median of "
             f"{args.saves}\n" + format_table(headers, rows))
    print(table)
    out = Path(args.out)
    write_report(out / "vllm_save_cpu.json", "vllm_save_cpu", {"args": vars(args),
                                                                "results": results})
    (out / "vllm_save_cpu.txt").write_text(table + "\n")


if __name__ == "__main__":
    main()
