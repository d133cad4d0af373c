"""``vllm_gpu.py``'s case: one vLLM engine (``Case``) in the child process that ``vllm_gpu.py
--case NAME --mode MODE`` starts, its measurements (TTFT, hits by tier, greedy tokens, the
throughput batch) and the settings every case shares (the case names, kvtier's variants, the
seeded prompts, the ``@@`` lines the parent reads). The child's main thread runs it; vLLM runs
its engine in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). ``log`` also serves the parent;
``engine/engine_vs_vllm.py``'s modules run ``Case`` and use the prompts, and
``vllm_serve_plan.py`` the token range.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

#: kvtier variants: connector options beside the defaults (``kvtier``), each a host-hit case.
VARIANTS = {"kvtier_kernel": {"copy_path": "kernel"},
            "kvtier_ce": {"copy_path": "copy_engine"},
            "kvtier_ce128": {"copy_path": "copy_engine", "page_size": 128},
            "kvtier_lp0": {"load_programs": 0},
            "kvtier_lp16": {"load_programs": 16},
            "kvtier_sp4": {"store_programs": 4},
            "kvtier_direct": {"direct": True},
            "kvtier_direct_uva": {"direct": True, "copy_path": "kernel"}}
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
                                     "pinned_budget_bytes": f"{a.host_gib + 2}GiB"}
            if self.name.startswith("disk"):    # the connector's defaults (direct on CUDA)
                extra["disk_url"] = f"file://{a.disk_dir}"
            extra.update(VARIANTS.get(self.name, {}))
            if not self.name.startswith("disk") and not extra.get("direct"):
                extra["staging_pages"] = a.staging_pages    # the staged path
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
            # they held: not a hit (the timing would flatter it), and a wrong answer. (The
            # direct path copies every layer at once, beside the forward: ``loads_async``.)
            bad = sum(1 for d in by_tier if d.get("claimed_tokens") and
                      not d.get("load_layer_copies") and not d.get("loads_async"))
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

    def connector_counts(self, keys: tuple[str, ...]) -> dict[str, int]:
        """kvtier's connector counters ``keys`` now ({} in a case without kvtier)."""
        if self.name not in KVTIER_CASES:
            return {}
        counts = self.runtime().stats()["connector"]
        return {k: int(counts.get(k, 0)) for k in keys}

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
                                                       "load_steps_whole", "loads_async")}
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
        if not self.res.get("served_unseen"):
            # A serving process has computed prompts before hits arrive: the connector's clock
            # learns vLLM's prefill rate from such steps (a step is timed when its requests run
            # on in the next: decode steps follow here; the warm-up alone runs one step).
            longest = max(self.args.lengths)
            self.res["served_unseen"] = [self.gen(prompt(longest, seed=900 + i), 8)[0]
                                         for i in range(2)]
        declined = self.connector_counts(("store_tokens_declined_slower",))
        t, _, cached = self.gen(p, 1)                  # the first request: from disk
        r["first_ttft_ms"], r["first_cached"] = round(t * 1e3, 2), cached
        hits = []
        for _ in range(self.args.repeats if timed else 0):
            self.drop_gpu_copies(("device", "host"))
            if self.args.disk_cache == "cold":    # the first request read the files in
                from disk_probe import evict

                evict(Path(self.args.disk_dir))
            hits.append(self.gen(p, 1))
        r["ttft_s"], r["cached"] = [t for t, _, _ in hits], [c for _, _, c in hits]
        if declined:     # tokens the connector left to vLLM as slower to read than compute
            after = self.connector_counts(("store_tokens_declined_slower",))
            r["declined_slower"] = after["store_tokens_declined_slower"] - \
                declined["store_tokens_declined_slower"]

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
        hooks = ("meta_builds", "meta_build_us", "worker_hooks_us", "lookup_us",
                 "save_plan_cpu_us", "save_copy_cpu_us", "save_commit_cpu_us", "saved_tokens",
                 "generated_saves")
        before = self.connector_counts(hooks)
        started = time.perf_counter()
        outs = self.llm.generate(batch, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        out = {"prompts": len(batch), "seconds": round(seconds, 3),
               "gen_tok_s": round(generated / seconds, 1),
               "cached": sum(int(o.num_cached_tokens or 0) for o in outs)}
        if before:      # the connector's CPU in the run (its step hooks, lookups, commits)
            after = self.connector_counts(hooks)
            out["connector"] = {k: after[k] - before[k] for k in hooks}
        log(f"{self.name}/{self.mode} throughput: {out}")
        return out
