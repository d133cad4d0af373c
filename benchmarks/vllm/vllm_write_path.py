"""CPU cost of the vLLM connector's write path per stored prompt, by thread, without vLLM's forward.

Runs inside ``.venv-vllm`` (it imports the connector)::

    PYTHONPATH=src .venv-vllm/bin/python benchmarks/vllm/vllm_write_path.py [--prompts 12]

Builds the connector's runtime as ``runtime_for`` does (the saver thread at idle priority, the
cache built on it, a disk tier in a temporary directory) over CPU KV tensors laid out as vLLM's
CPU backend lays them out (``bench_vllm``'s model: 8 layers, 8 KV heads of 64, float32, blocks
and pages of 128 tokens), then stores ``--prompts`` distinct prompts of ``--tokens`` tokens
through the saver (plan, layer copies, commit; the write policy's host copy; the disk tier's
writes on kvtier's IO threads) and waits until everything is on disk. Prompts enough to fill
the host pool once are stored first and not counted: the first write into a fresh host page
faults it in (on the 2-core VM this was written on, 48 MB of first-touch writes cost ~40 ms of
CPU, the same writes again ~9 ms), which a running server pays once per page.

Reports the process CPU time per stored prompt, split by thread name (``/proc/self/task/*/stat``),
for the disk tier's buffered and O_DIRECT (``?direct=true``) writes side by side, the saver's
own counters and the KV bytes per CPU second. Nothing else runs in the process, so the split is
the write path's alone. ``--profile`` also runs the saver thread's work under ``cProfile`` and
prints its top functions. Writes ``benchmarks/results/vllm_write_path.json`` and ``.txt``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from kvtier.machine import format_table, write_report  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 8, 8, 64, 128
HOST_POOL_BYTES = 512 << 20         # bench_vllm's
RESULTS = ROOT / "benchmarks" / "results"
#: The disk tier's two write paths: buffered (page cache) and O_DIRECT (``?direct=true``).
DISK_MODES = {"disk buffered": "", "disk direct": "?direct=true"}
TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu() -> Counter[str]:
    """CPU seconds so far of every live thread of this process, summed by thread name (Python's
    name where the thread is a Python thread, else the OS's: torch's OpenMP threads)."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: Counter[str] = Counter()
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:             # the thread ended meanwhile
            continue
        name = names.get(int(task.name)) or "os:" + stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[_group(name)] += (int(fields[11]) + int(fields[12])) / TICKS   # utime + stime
    return out


def _group(name: str) -> str:
    """Thread names without their trailing numbers (``kvtier-io-3`` -> ``kvtier-io``)."""
    return name.rstrip("0123456789_-") or name


def build(tmp: Path, disk_query: str) -> tuple[Any, Any]:
    from kvtier.integrations.vllm.layout import BlockLayout
    from kvtier.integrations.vllm.options import parse_connector_config
    from kvtier.integrations.vllm.runtime import (
        ConnectorRuntime,
        ModelShape,
        _build_cache_here,
    )
    from kvtier.integrations.vllm.saver import Saver
    from kvtier.integrations.vllm.saves import SaveCopier
    from kvtier.keys import KeyNamespace

    options = parse_connector_config({"disk_url": f"file://{tmp / 'disk'}{disk_query}",
                                      "host_pool_bytes": HOST_POOL_BYTES, "staging_pages": 64}, BLOCK)
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
    shape = ModelShape("bench", names, KV_HEADS, HEAD_DIM, "float32", BLOCK)
    layout = shape.layout(options.config.cache.page_size)
    namespace = KeyNamespace("bench", "bench", "float32", layout.fingerprint(), BLOCK)
    saver = Saver(options.save_queue_depth, options.background_priority)
    cache = saver.call(lambda: _build_cache_here(options, layout, namespace, "cpu"))
    runtime = ConnectorRuntime(options, shape, cache, namespace, saver)
    blocks = 256
    kv = {n: torch.randn(blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM) for n in names}
    saver.copier = SaveCopier(runtime, kv, BlockLayout("cpu", blocks, BLOCK, KV_HEADS, HEAD_DIM))
    return runtime, blocks


def store_prompts(runtime: Any, blocks: int, n: int, tokens: int, seed: int) -> None:
    from kvtier.integrations.vllm.scheduler import SaveSpec

    rng = random.Random(seed)
    per = -(-tokens // BLOCK)
    for i in range(n):
        prompt = tuple(rng.randrange(5, 1000) for _ in range(tokens))
        start = (i * per) % (blocks - per)
        spec = SaveSpec(f"r{seed}-{i}", prompt, None, tuple(range(start, start + per)))
        while not runtime.saver.submit(spec.req_id, spec=spec):
            time.sleep(0.01)        # the queue is bounded: wait here, not in vLLM
    assert runtime.drain(300.0), "saves did not drain"


def measure(n: int, tokens: int, disk_query: str, profile: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvtier-write-path-", dir=ROOT) as tmp:
        runtime, blocks = build(Path(tmp), disk_query)
        kv_bytes = tokens // BLOCK * BLOCK * LAYERS * 2 * KV_HEADS * HEAD_DIM * 4
        warm = -(-HOST_POOL_BYTES // kv_bytes) + 1   # once round the host pool: steady state
        store_prompts(runtime, blocks, warm, tokens, seed=0)    # not counted
        profiler = cProfile.Profile() if profile else None
        if profiler is not None:
            runtime.saver.call(profiler.enable)
        before_counts = Counter(runtime.stats()["connector"])
        before, wall = thread_cpu(), time.perf_counter()
        store_prompts(runtime, blocks, n, tokens, seed=1)
        after, wall = thread_cpu(), time.perf_counter() - wall
        counts = Counter(runtime.stats()["connector"])
        counts.subtract(before_counts)
        if profiler is not None:
            runtime.saver.call(profiler.disable)
        runtime.close()
    cpu = {name: (after[name] - before.get(name, 0.0)) * 1e3 / n for name in after}
    total = sum(cpu.values())
    out: dict[str, Any] = {
        "disk_url_query": disk_query, "prompts": n, "prompt_tokens": tokens, "kv_bytes_per_prompt": kv_bytes,
        "cpu_ms_per_prompt_by_thread": {k: v for k, v in sorted(cpu.items()) if v > 0.05},
        "cpu_ms_per_prompt": total, "wall_s": wall,
        "mb_per_cpu_s": kv_bytes / 1e6 / (total / 1e3) if total else None,
        "saver_copy_ms_per_prompt": counts["save_copy_cpu_us"] / 1e3 / n,
        "saver_commit_ms_per_prompt": counts["save_commit_cpu_us"] / 1e3 / n,
        "saved_tokens": counts["saved_tokens"],
    }
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        out["saver_profile"] = text.getvalue()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=1536)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default=str(RESULTS / "vllm_write_path.json"))
    args = parser.parse_args()
    runs = {name: measure(args.prompts, args.tokens, query, args.profile)
            for name, query in DISK_MODES.items()}
    threads = sorted({t for run in runs.values() for t in run["cpu_ms_per_prompt_by_thread"]})
    rows = [[t, *(run["cpu_ms_per_prompt_by_thread"].get(t, 0.0) for run in runs.values())]
            for t in threads]
    rows.append(["total", *(run["cpu_ms_per_prompt"] for run in runs.values())])
    rows.append(["MB of KV per CPU second", *(run["mb_per_cpu_s"] for run in runs.values())])
    rows.append(["saver counters: copies", *(r["saver_copy_ms_per_prompt"] for r in runs.values())])
    rows.append(["saver counters: commits",
                 *(r["saver_commit_ms_per_prompt"] for r in runs.values())])
    table = format_table(["CPU ms per stored prompt", *runs], rows)
    first = next(iter(runs.values()))
    walls = ", ".join(f"{name} {run['wall_s']:.2f}" for name, run in runs.items())
    summary = (f"{table}\n\n{first['prompts']} prompts of {first['prompt_tokens']} tokens, "
               f"{first['kv_bytes_per_prompt'] / 1e6:.1f} MB of KV each; wall seconds: "
               f"{walls}\n")
    print(summary)
    for name, run in runs.items():
        if args.profile:
            print(name, run["saver_profile"])
    out = write_report(args.out, "vllm_write_path", {"runs": runs})
    out.with_suffix(".txt").write_text(summary)


if __name__ == "__main__":
    main()
