"""kvtier's connector inside a real CUDA vLLM, side by side with vLLM's own paths, in one run.

Every case runs in a fresh process (``--case NAME``) on one GPU, with an 8B-shaped model
(``--preset``, random weights: ``load_format="dummy"``, nothing downloaded), bf16, prompts of
``--lengths`` tokens (seeded random ids), an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING
=0``) so the script reaches kvtier's runtime. TTFT is the wall time of ``llm.generate`` with
``max_tokens=1``, the median of ``--repeats`` runs. Cases, each under vLLM's default compilation
(``graphs``: torch.compile and CUDA graphs) and ``--eager``, as ``--modes`` says:

- ``recompute``: vLLM alone, prefix caching off (the baseline of every ratio);
- ``alone``: vLLM alone, prefix caching on: a GPU prefix hit (the same prompt again) and the
  TTFT of prompts it has not seen (the miss path's baseline); with ``graphs``, the serving
  throughput of ``--batch`` distinct ~5k-token prompts of 128 new tokens each, at once;
- ``native``: vLLM's native CPU offloading (``kv_offloading_backend="native"``,
  ``--offload-gib``): store, let the offload land, reset the GPU prefix cache, replay;
- ``kvtier``: kvtier's connector, host tier only (``--host-gib``): store, drain, forget kvtier's
  device tier, reset vLLM's prefix cache, replay (a host-tier hit); then, as in ``alone``, the
  TTFT of unseen prompts and (``graphs``) the throughput with kvtier on and no hit (the miss
  path);
- ``disk_store`` then ``disk_hit``: kvtier with a disk tier; the first process stores the
  prompts and exits (its exit hook drains the writes), a fresh one serves them from disk
  (its first request of each prompt), then forgets its host and device tiers and serves them
  again ``--repeats`` times.

Every hit also generates 16 greedy tokens, compared with ``recompute``'s in the same mode; the
``--check-lengths`` prompts (one token past a page, so the hit leaves a single token to compute:
a full-CUDA-graph decode step under ``graphs``) are checked for tokens only.

    PYTHONPATH=src python3 benchmarks/vllm/vllm_gpu.py --out $OUT        # on the GPU machine

prints a table per mode and writes ``vllm_gpu.json`` (results, ratios, machine) and
``vllm_gpu_cases.log`` (every child's output) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

#: kvtier variants: connector options beside the defaults (``kvtier``), each a host-hit case.
VARIANTS = {"kvtier_ce": {"copy_path": "copy_engine"},
            "kvtier_ce128": {"copy_path": "copy_engine", "page_size": 128},
            "kvtier_lp0": {"load_programs": 0},
            "kvtier_lp16": {"load_programs": 16},
            "kvtier_sp4": {"store_programs": 4}}
CASES = ("recompute", "alone", "native", "kvtier", *VARIANTS, "disk_store", "disk_hit")
KVTIER_CASES = ("kvtier", *VARIANTS, "disk_store", "disk_hit")
TOKEN_LOW, TOKEN_HIGH = 5, 1000            # ordinary tokens of kvtier's tiny tokenizer
GEN_TOKENS = 16
TOP_LOGPROBS = 8
THROUGHPUT_PROMPT, THROUGHPUT_NEW = 4980, 128


def log(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def emit(kind: str, **data: Any) -> None:
    print(f"@@{kind} " + json.dumps(data, default=str), flush=True)


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed * 1_000_003 + length)
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(length)]


# ================================================================================================
# child: one case in one process
# ================================================================================================
class Case:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.name, self.mode = args.case, args.mode
        self.res: dict[str, Any] = {"case": self.name, "mode": self.mode, "ok": False,
                                    "lengths": {}}
        self.llm: Any = None

    # ---- engine -----------------------------------------------------------------------------
    def build(self) -> None:
        import torch
        import vllm
        from vllm import LLM

        a = self.args
        gpu = torch.cuda.is_available()
        self.res["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__,
                                "gpu": torch.cuda.get_device_name(0) if gpu else None}
        kw: dict[str, Any] = dict(
            model=a.model_dir, load_format="dummy", dtype=a.dtype, seed=0,
            max_model_len=a.max_model_len, block_size=a.block_size,
            enforce_eager=self.mode == "eager",
            enable_prefix_caching=self.name != "recompute", max_num_seqs=a.max_num_seqs,
            disable_log_stats=True)
        if gpu:
            kw["gpu_memory_utilization"] = a.gpu_mem
        else:                   # vLLM's CPU build (a check of this script): a small KV cache
            kw["kv_cache_memory_bytes"] = 256 << 20
        if self.name == "native":
            kw.update(kv_offloading_size=a.offload_gib, kv_offloading_backend="native")
        if self.name in KVTIER_CASES:
            from vllm.config import KVTransferConfig

            extra: dict[str, Any] = {"host_pool_bytes": f"{a.host_gib}GiB",
                                     "pinned_budget_bytes": f"{a.host_gib + 2}GiB",
                                     "staging_pages": a.staging_pages}
            if self.name.startswith("disk"):
                extra["disk_url"] = f"file://{a.disk_dir}"
            extra.update(VARIANTS.get(self.name, {}))
            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector="KvtierConnector",
                kv_connector_module_path="kvtier.integrations.vllm",
                kv_role="kv_both", kv_connector_extra_config=extra)
        started = time.perf_counter()
        self.llm = LLM(**kw)
        self.res["init_s"] = round(time.perf_counter() - started, 1)
        log(f"{self.name}/{self.mode}: engine built in {self.res['init_s']} s")

    def gen(self, ids: list[int], max_tokens: int = 1,
            logprobs: int | None = None) -> tuple[float, list[int], int]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                detokenize=False, logprobs=logprobs)
        started = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        self.last_logprobs = ({str(t): float(lp.logprob) for t, lp in out.outputs[0].logprobs[0]
                               .items()} if logprobs and out.outputs[0].logprobs else None)
        return (time.perf_counter() - started, list(out.outputs[0].token_ids),
                int(out.num_cached_tokens or 0))

    def settle(self, timeout_s: float = 30.0) -> None:
        """Step the engine while its scheduler holds requests (stores still in flight)."""
        engine = self.llm.llm_engine
        core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
        sched = getattr(core, "scheduler", None)
        deadline = time.monotonic() + timeout_s
        while sched is not None and sched.has_requests() and time.monotonic() < deadline:
            engine.step()

    def runtime(self) -> Any:
        from kvtier.integrations.vllm.runtime import runtimes

        return runtimes()[0]

    def drop_gpu_copies(self, tiers: tuple[str, ...] = ("device",)) -> None:
        """Make the next request for a stored prompt miss vLLM's GPU cache (and kvtier's
        ``tiers``): saves and offloads land first."""
        if self.name in KVTIER_CASES:
            self.runtime().drain(60.0)
        self.settle()
        for _ in range(20):
            if self.llm.reset_prefix_cache():
                break
            self.gen(prompt(2 * self.args.block_size, seed=99), 1)
            self.settle()
        else:
            self.res.setdefault("warnings", []).append("vLLM's prefix cache did not reset")
        self.zero_vllm_kv()
        if self.name in KVTIER_CASES:
            # One step more: a load whose copy had not landed when its step ended is released
            # at the next step, and until then its pages stay on kvtier's device tier.
            self.gen(prompt(2 * self.args.block_size, seed=98), 1)
            self.runtime().drain(60.0)
            rt = self.runtime()
            with rt.lock:
                for tier in tiers:
                    rt.cache.clear_tier(tier)

    def zero_vllm_kv(self) -> None:
        """Zero every block of vLLM's KV cache (none is in use after the reset): a hit must
        bring its KV back itself; stale blocks left by the last run of the same prompt would
        hide a load the forward did not wait for."""
        import torch

        ctx = self.llm.llm_engine.vllm_config.compilation_config.static_forward_context
        zeroed = 0
        for layer in ctx.values():
            held = getattr(layer, "kv_cache", None)
            for kv in ([held] if isinstance(held, torch.Tensor) else list(held or ())):
                if isinstance(kv, torch.Tensor) and kv.numel():
                    kv.zero_()
                    zeroed += 1
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.res["kv_tensors_zeroed"] = zeroed

    # ---- the measurements -------------------------------------------------------------------
    def run(self) -> None:
        a = self.args
        self.build()
        self.gen(prompt(a.lengths[0], seed=7), 1)                  # warm-up
        for length in (*a.lengths, *a.check_lengths):
            r: dict[str, Any] = {}
            self.res["lengths"][str(length)] = r
            p = prompt(length, seed=1)
            timed = length in a.lengths
            getattr(self, f"case_{self.name}")(p, r, timed)
            if timed and r.get("ttft_s"):
                r["ttft_median_ms"] = round(statistics.median(r["ttft_s"]) * 1e3, 2)
            if self.name != "disk_store":
                self.tokens(p, r)
            log(f"{self.name}/{self.mode} {length}: " + json.dumps(
                {k: v for k, v in r.items() if k not in ("tokens16",)}, default=str)[:400])
            emit("LENGTH", length=length, result=r)
        if (self.name == "alone" or self.name.startswith("kvtier")) and self.mode == "graphs" \
                and a.batch:
            self.res["throughput"] = self.throughput()
        if self.name in KVTIER_CASES:
            self.res["kvtier"] = self.runtime().stats()["connector"]
        self.res["ok"] = True

    def tokens(self, p: list[int], r: dict[str, Any]) -> None:
        """16 greedy tokens, from the state the measured runs were in (a hit where there is one)."""
        if self.name in ("native", "disk_hit") or self.name.startswith("kvtier"):
            self.drop_gpu_copies()
        _, toks, cached = self.gen(p, GEN_TOKENS, logprobs=TOP_LOGPROBS)
        r["tokens16"], r["tokens16_cached"] = toks, cached
        # With random weights greedy tokens barely depend on the context (a hit served from
        # empty blocks can still match them); the first token's top logprobs do depend on it.
        r["first_logprobs"] = self.last_logprobs

    def case_recompute(self, p: list[int], r: dict[str, Any], timed: bool) -> None:
        runs = [self.gen(p, 1) for _ in range(self.args.repeats if timed else 0)]
        r["ttft_s"] = [t for t, _, _ in runs]

    def unseen(self, length: int, r: dict[str, Any]) -> None:
        runs = [self.gen(prompt(length, seed=1000 + i), 1) for i in range(self.args.repeats)]
        r["unseen_ttft_ms"] = round(statistics.median(t for t, _, _ in runs) * 1e3, 2)
        r["unseen_cached"] = [c for _, _, c in runs]
        if self.args.profile:
            r["profile_unseen"] = self.profiled(prompt(length, seed=2000))

    def case_alone(self, p: list[int], r: dict[str, Any], timed: bool) -> None:
        self.gen(p, 1)
        runs = [self.gen(p, 1) for _ in range(self.args.repeats if timed else 0)]
        r["ttft_s"], r["cached"] = [t for t, _, _ in runs], [c for _, _, c in runs]
        if timed:
            self.unseen(len(p), r)

    def _store_then_hits(self, p: list[int], r: dict[str, Any], timed: bool,
                         tiers: tuple[str, ...] = ("device",)) -> None:
        self.gen(p, 1)
        if self.name in KVTIER_CASES:         # a save refused under pressure: store it again
            r["store_tries"] = 1
            while self.held(p) < len(p) - self.args.block_size and r["store_tries"] < 3:
                self.runtime().drain(60.0)
                self.drop_gpu_copies()
                self.gen(p, 1)
                r["store_tries"] += 1
        hits, by_tier = [], []
        for _ in range(self.args.repeats if timed else 0):
            self.drop_gpu_copies(tiers)
            before = self.tier_hits()
            hits.append(self.gen(p, 1))
            after = self.tier_hits()
            by_tier.append({k: after[k] - before.get(k, 0) for k in after
                            if after[k] != before.get(k, 0)})
        r["ttft_s"], r["cached"] = [t for t, _, _ in hits], [c for _, _, c in hits]
        if self.name in KVTIER_CASES:
            r["hit_tokens_by_tier"] = by_tier
            # A claimed hit whose layers were never copied into vLLM's blocks read whatever
            # they held: not a hit (the timing would flatter it), and a wrong answer.
            bad = sum(1 for d in by_tier if d.get("claimed_tokens") and
                      not d.get("load_layer_copies"))
            if bad:
                self.res.setdefault("warnings", []).append(
                    f"{len(p)} tokens: {bad} claimed hit(s) copied no layer into vLLM's blocks")
        if timed and self.args.profile:
            self.drop_gpu_copies(tiers)
            r["profile"] = self.profiled(p)

    def profiled(self, p: list[int]) -> dict[str, Any]:
        """One more hit under torch.profiler: its wall time and the operations that took the
        most CUDA and CPU time (where a hit's milliseconds go)."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        gpu = torch.cuda.is_available()
        acts = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if gpu else [])]
        with profile(activities=acts) as prof:
            t, _, cached = self.gen(p, 1)
        table = prof.key_averages()
        def top(key: str) -> list[dict[str, Any]]:
            rows = sorted(table, key=lambda e: getattr(e, key), reverse=True)[:14]
            return [{"name": e.key[:90], "calls": e.count,
                     "self_cuda_ms": round(e.self_device_time_total / 1e3, 3),
                     "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3)} for e in rows]
        return {"ttft_ms": round(t * 1e3, 2), "cached": cached,
                "by_cuda": top("self_device_time_total"), "by_cpu": top("self_cpu_time_total")}

    def held(self, p: list[int]) -> int:
        rt = self.runtime()
        rt.drain(60.0)
        with rt.lock:
            return int(rt.cache.match(p).tokens)

    def tier_hits(self) -> dict[str, int]:
        if self.name not in KVTIER_CASES:
            return {}
        stats = self.runtime().stats()
        counts = stats["connector"]
        out = {k: v for k, v in counts.items()
               if k.startswith("hit_tokens_") or k in ("lookup_us", "lookup_lock_wait_us",
                                                       "claimed_tokens", "load_layer_copies",
                                                       "load_steps_whole")}
        copy = (stats.get("cache") or {}).get("copy") or {}
        if "load_bytes" in copy:
            out["copied_to_gpu_bytes"] = copy["load_bytes"]
        return out

    def case_native(self, p: list[int], r: dict[str, Any], timed: bool) -> None:
        self._store_then_hits(p, r, timed)

    def case_kvtier(self, p: list[int], r: dict[str, Any], timed: bool) -> None:
        if timed and self.args.unseen:  # first: the prompt's own pages stay the newest
            self.unseen(len(p), r)
        self._store_then_hits(p, r, timed)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("case_kvtier_"):                     # the variants
            return self.case_kvtier
        raise AttributeError(name)

    def case_disk_store(self, p: list[int], r: dict[str, Any], timed: bool) -> None:
        _, _, cached = self.gen(p, 1)
        r["stored"] = self.runtime().drain(120.0)
        r["cached"] = [cached]

    def case_disk_hit(self, p: list[int], r: dict[str, Any], timed: bool) -> None:
        t, _, cached = self.gen(p, 1)                  # the first request: from disk
        r["first_ttft_ms"], r["first_cached"] = round(t * 1e3, 2), cached
        hits = []
        for _ in range(self.args.repeats if timed else 0):
            self.drop_gpu_copies(("device", "host"))
            hits.append(self.gen(p, 1))
        r["ttft_s"], r["cached"] = [t for t, _, _ in hits], [c for _, _, c in hits]

    def throughput(self) -> dict[str, Any]:
        from vllm import SamplingParams

        a = self.args
        params = SamplingParams(max_tokens=THROUGHPUT_NEW, temperature=0.0, ignore_eos=True,
                                detokenize=False)
        batch = [{"prompt_token_ids": prompt(THROUGHPUT_PROMPT, seed=5000 + i)}
                 for i in range(a.batch)]
        self.llm.generate(batch[:2], params, use_tqdm=False)   # warm-up (and graph shapes)
        batch = batch[2:] + [{"prompt_token_ids": prompt(THROUGHPUT_PROMPT, seed=6000 + i)}
                             for i in range(2)]
        started = time.perf_counter()
        outs = self.llm.generate(batch, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        out = {"prompts": len(batch), "seconds": round(seconds, 3),
               "gen_tok_s": round(generated / seconds, 1),
               "cached": sum(int(o.num_cached_tokens or 0) for o in outs)}
        log(f"{self.name}/{self.mode} throughput: {out}")
        return out


def child_main(args: argparse.Namespace) -> None:
    case, code = Case(args), 0
    try:
        case.run()
    except BaseException as exc:
        case.res["error"] = f"{type(exc).__name__}: {exc}"
        print(traceback.format_exc()[-6000:], flush=True)
        code = 1
    emit("RESULT", **case.res)
    sys.stdout.flush()
    if case.name == "disk_store" and case.llm is not None:
        from kvtier.integrations.vllm.runtime import runtimes

        for rt in runtimes():                              # writes reach the disk first
            rt.close(120.0)
    os._exit(code)           # skip interpreter teardown (engine threads can hang it)


# ================================================================================================
# parent
# ================================================================================================
def build_model_dir(preset: str, dest: Path) -> None:
    from kvtier.engine.presets import PRESETS, TOKENIZER_DIR

    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(dict(PRESETS[preset].config), indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, dest / name)


def run_child(args: argparse.Namespace, case: str, mode: str, timeout_s: float,
              logf: Any, script: str = __file__) -> dict[str, Any]:
    """Run ``script --case CASE --mode MODE`` (and ``args.child_argv``) in a fresh process,
    killed after ``timeout_s``; its ``@@RESULT`` line is the result (or an error and the tail
    of its output)."""
    cmd = [sys.executable, "-u", script, "--case", case, "--mode", mode, *args.child_argv]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1")
    result: dict[str, Any] = {"case": case, "mode": mode, "ok": False, "lengths": {}}
    logf.write(f"\n===== {case} / {mode} =====\n")
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, stdin=subprocess.DEVNULL, bufsize=1)
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    tail: list[str] = []
    try:
        for line in proc.stdout:                            # type: ignore[union-attr]
            logf.write(line)
            line = line.rstrip("\n")
            tail = (tail + [line])[-30:]
            if line.startswith("@@RESULT "):
                result = json.loads(line[len("@@RESULT "):])
            elif line.startswith("@@LENGTH "):
                part = json.loads(line[len("@@LENGTH "):])
                result["lengths"][str(part["length"])] = part["result"]
            elif line.startswith("[bench]") or "Traceback" in line or "Error" in line:
                print(f"  {line[:300]}", flush=True)
        proc.wait()
    finally:
        timer.cancel()
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if not result.get("ok"):
        result.setdefault("error", f"exit {proc.returncode}")
        result["tail"] = tail
    return result


def summarize(args: argparse.Namespace, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode and length: each case's TTFT, the ratios the goals name, token agreement."""
    from kvtier.machine import format_table

    by = {(r["case"], r["mode"]): r for r in results}
    summary: dict[str, Any] = {}
    for mode in args.modes:
        rows, table = [], {}
        for length in (*args.lengths, *args.check_lengths):
            key = str(length)

            def cell(case: str, field: str = "ttft_median_ms", key: str = key,
                     mode: str = mode) -> Any:
                run_mode = args.disk_mode if case in ("disk_store", "disk_hit") else mode
                return by.get((case, run_mode), {}).get("lengths", {}).get(key, {}).get(field)

            want_lp = cell("recompute", "first_logprobs")
            lp_diff = {c: _logprob_gap(want_lp, cell(c, "first_logprobs"))
                       for c in ("alone", "native", "kvtier", *VARIANTS, "disk_hit")
                       if cell(c, "first_logprobs")}
            want = cell("recompute", "tokens16")
            agree = {c: (cell(c, "tokens16") == want if want and cell(c, "tokens16") else None)
                     for c in ("alone", "native", "kvtier", *VARIANTS, "disk_hit")}
            line = {"recompute_ms": cell("recompute"), "gpu_hit_ms": cell("alone"),
                    "native_hit_ms": cell("native"), "kvtier_host_hit_ms": cell("kvtier"),
                    "kvtier_disk_first_ms": cell("disk_hit", "first_ttft_ms"),
                    "kvtier_disk_hit_ms": cell("disk_hit"),
                    "alone_unseen_ms": cell("alone", "unseen_ttft_ms"),
                    "kvtier_unseen_ms": cell("kvtier", "unseen_ttft_ms"),
                    "kvtier_cached": cell("kvtier", "cached"),
                    "native_cached": cell("native", "cached"),
                    "tokens_equal": agree,
                    "first_token_logprob_gap": lp_diff}
            ratio = _ratio
            line["kvtier_over_native"] = ratio(line["kvtier_host_hit_ms"], line["native_hit_ms"])
            for variant in VARIANTS:
                line[f"{variant}_host_hit_ms"] = cell(variant)
                line[f"{variant}_over_native"] = ratio(cell(variant), line["native_hit_ms"])
                line[f"{variant}_miss_over_alone"] = ratio(cell(variant, "unseen_ttft_ms"),
                                                           line["alone_unseen_ms"])
            line["recompute_over_disk"] = ratio(line["recompute_ms"], line["kvtier_disk_hit_ms"])
            line["miss_over_alone"] = ratio(line["kvtier_unseen_ms"], line["alone_unseen_ms"])
            table[key] = line
            rows.append([length, line["recompute_ms"], line["gpu_hit_ms"], line["native_hit_ms"],
                         line["kvtier_host_hit_ms"], line["kvtier_over_native"],
                         line["kvtier_disk_hit_ms"], line["recompute_over_disk"],
                         line["miss_over_alone"],
                         " ".join(f"{c}={'y' if v else ('n' if v is False else '-')}"
                                  for c, v in agree.items())])
        for length in (*args.lengths, *args.check_lengths):
            gaps = table[str(length)]["first_token_logprob_gap"]
            if gaps:
                print(f"{length} tokens: first token's top-{TOP_LOGPROBS} logprobs, largest gap "
                      "to recompute's: " + ", ".join(f"{c} {g}" for c, g in gaps.items()))
        variants = [(length, v, table[str(length)][f"{v}_host_hit_ms"],
                     table[str(length)][f"{v}_over_native"],
                     table[str(length)][f"{v}_miss_over_alone"]) for length in args.lengths
                    for v in VARIANTS if table[str(length)][f"{v}_host_hit_ms"] is not None]
        thr = {c: by.get((c, mode), {}).get("throughput") for c in ("alone", "kvtier", *VARIANTS)}
        for c in ("kvtier", *VARIANTS):
            if thr["alone"] and thr[c]:
                thr[f"{c}_over_alone"] = ratio(thr[c]["gen_tok_s"], thr["alone"]["gen_tok_s"])
        table["throughput"] = thr
        summary[mode] = table
        print(f"\n== {mode} (TTFT ms, median of {args.repeats}) ==")
        print(format_table(["tokens", "recompute", "gpu hit", "native hit", "kvtier host",
                            "kv/native", "kvtier disk", "recomp/disk", "miss/alone",
                            "16 tokens = recompute"], rows))
        for length, variant, ms, over, miss in variants:
            print(f"{length} tokens: {variant} ({VARIANTS[variant]}) host hit {ms} ms, "
                  f"{over}x native; miss {miss}x alone")
        for (case, run_mode), res in sorted(by.items()):
            for length, r in res.get("lengths", {}).items():
                for what in ("profile", "profile_unseen"):
                    prof = r.get(what) if run_mode == mode else None
                    if prof:
                        print(f"{case} {length} tokens, one profiled "
                              f"{'hit' if what == 'profile' else 'miss'} ({prof['ttft_ms']} ms)"
                              ", most CUDA time: " + "; ".join(
                                  f"{e['name'][:48]} x{e['calls']} {e['self_cuda_ms']} ms"
                                  for e in prof["by_cuda"][:6]))
        if thr.get("kvtier_over_alone") is not None:
            print(f"throughput, {args.batch} prompts x {THROUGHPUT_PROMPT} tokens, "
                  f"{THROUGHPUT_NEW} new: alone {thr['alone']['gen_tok_s']} gen tok/s, kvtier "
                  f"on (no hit) {thr['kvtier']['gen_tok_s']} ({thr['kvtier_over_alone']}x)")
        for c in VARIANTS:
            if thr.get(f"{c}_over_alone") is not None:
                print(f"throughput {c} ({VARIANTS[c]}): {thr[c]['gen_tok_s']} gen tok/s "
                      f"({thr[f'{c}_over_alone']}x alone)")
    return summary


def _logprob_gap(want: dict[str, float] | None, got: dict[str, float] | None) -> float | None:
    """Largest |logprob difference| over the recompute's top tokens (a token missing from the
    hit's top list counts as its whole logprob): about 0.1 or less is bf16 noise between two
    batch shapes; a hit served from the wrong KV moves them by whole units."""
    if not want or not got:
        return None
    floor = min(got.values())
    return round(max(abs(lp - got.get(t, floor)) for t, lp in want.items()), 4)


def _ratio(a: Any, b: Any) -> float | None:
    return round(a / b, 3) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b \
        else None


def parent_main(args: argparse.Namespace) -> None:
    from kvtier.machine import write_report

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    build_model_dir(args.preset, Path(args.model_dir))
    shutil.rmtree(args.disk_dir, ignore_errors=True)
    plan = [(c, m) for m in args.modes for c in args.cases if c not in ("disk_store", "disk_hit")]
    if "disk_store" in args.cases:
        plan += [("disk_store", args.disk_mode), ("disk_hit", args.disk_mode)]
    deadline = time.monotonic() + args.budget_s
    results = []
    with open(out / "vllm_gpu_cases.log", "w") as logf:
        for case, mode in plan:
            left = deadline - time.monotonic()
            if left < 30:
                results.append({"case": case, "mode": mode, "ok": False, "error": "no time left"})
                continue
            log(f"case {case} / {mode} ({left:.0f} s left)")
            results.append(run_child(args, case, mode, min(left, args.case_timeout_s), logf))
            logf.flush()
            write_report(out / "vllm_gpu.json", "vllm_gpu", {     # so far (a cut-off run keeps it)
                "args": {k: v for k, v in vars(args).items() if k != "child_argv"},
                "cases": results})
    summary = summarize(args, results)
    failed = [f"{r['case']}/{r['mode']}: {r.get('error')}" for r in results if not r.get("ok")]
    if failed:
        print("failed cases: " + "; ".join(failed))
    for r in results:
        for warning in r.get("warnings", ()):
            print(f"WARNING {r['case']}/{r['mode']}: {warning}")
    write_report(out / "vllm_gpu.json", "vllm_gpu", {
        "args": {k: v for k, v in vars(args).items() if k != "child_argv"},
        "summary": summary, "cases": results})
    print(f"wrote {out / 'vllm_gpu.json'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=CASES, help="(internal) run one case in this process")
    p.add_argument("--mode", choices=("graphs", "eager"), default="eager")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--modes", default="graphs,eager")
    p.add_argument("--disk-mode", default="eager", help="mode of the disk cases")
    p.add_argument("--preset", default="llama3-8b-shape")
    p.add_argument("--model-dir", default="/tmp/kvtier_bench_model")
    p.add_argument("--disk-dir", default="/tmp/kvtier_bench_disk")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--lengths", default="4096,32768")
    p.add_argument("--check-lengths", default="4097")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=33024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-mem", type=float, default=0.6)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="throughput prompts (0: none)")
    p.add_argument("--profile", type=int, default=0,
                   help="1: one more hit per host-hit case under torch.profiler (top operations)")
    p.add_argument("--unseen", type=int, default=1, help="time unseen prompts (the miss path)")
    p.add_argument("--offload-gib", type=float, default=12.0,
                   help="vLLM's native CPU offloading size, and kvtier's host tier")
    p.add_argument("--staging-pages", type=int, default=2600,
                   help="kvtier's device pool (pages of --block-size tokens)")
    p.add_argument("--budget-s", type=float, default=560.0, help="all cases together")
    p.add_argument("--case-timeout-s", type=float, default=240.0)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args, _ = p.parse_known_args()
    args.child_argv = [a for a in sys.argv[1:]]
    args.host_gib = int(args.offload_gib)
    args.lengths = [int(x) for x in str(args.lengths).split(",") if x]
    args.check_lengths = [int(x) for x in str(args.check_lengths).split(",") if x]
    args.modes = [m for m in str(args.modes).split(",") if m]
    args.cases = [c for c in str(args.cases).split(",") if c]
    if args.case:
        child_main(args)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
