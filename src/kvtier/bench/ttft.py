"""The TTFT benchmark's measurement: time to first token per cache tier and prefix length.

Owns ``TtftPlan``, ``TIER_SPECS``, ``TtftRun`` and ``run_ttft`` (a whole run from a config: the
plan, the model, the run with a progress bar, its summary with the goals of ``ttft_report`` and
the setup). Every measured request is paired with a recompute of the same prompt length on the
same model with kvtier off (``--no-cache``), so ratios compare runs taken seconds apart. For
each prefix length and repeat, a fresh random prefix is sent once with kvtier on (the miss
path, 0% hits, timed against recompute, the baseline first in one pair and kvtier first in the
next), its pages settle into the tiers, then for each tier the tiers above it are dropped (and
the page cache, for the disk) and the same prefix is sent with a new suffix. Runs the engine
in-process (no HTTP, no web framework), so it runs where only torch and transformers are
installed. Main thread; the engine thread does the work.
"""

from __future__ import annotations

import random
import shutil
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtier.bench.coldcache import drop_page_cache
from kvtier.bench.ttft_report import goals
from kvtier.config import KvtierConfig
from kvtier.engine.hf import CausalLM, load_model
from kvtier.engine.request import GenerationRequest
from kvtier.engine.service import EngineService


@dataclass(frozen=True)
class TierSpec:
    """How to make a hit come from one tier: which store, which tiers to drop, how to split."""

    group: str                       # tiers of one group share one service and its prefixes
    drop: tuple[str, ...] = ()
    split: str = "plan"
    cold_disk: bool = False


TIER_SPECS: dict[str, TierSpec] = {
    "device": TierSpec("local"),
    "host": TierSpec("local", drop=("device",)),
    "disk": TierSpec("disk", drop=("device", "host"), cold_disk=True),
    "disk-load": TierSpec("disk", drop=("device", "host"), split="load", cold_disk=True),
    "redis": TierSpec("redis", drop=("device", "host")),
    "redis-load": TierSpec("redis", drop=("device", "host"), split="load"),
}
TIER_NAMES = ("recompute", *TIER_SPECS)


@dataclass(frozen=True)
class TtftPlan:
    prefix_tokens: tuple[int, ...]
    tiers: tuple[str, ...]
    repeats: int = 3
    suffix_tokens: int = 32
    seed: int = 0
    disk_url: str = ""
    redis_url: str = ""
    whole_machine_drop: bool = False   # cold disk: drop the machine's page cache (root)


@dataclass
class Samples:
    """Paired timings (seconds) of one tier at one prefix length."""

    hit: list[float] = field(default_factory=list)
    recompute: list[float] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    recomputed_hit_tokens: list[int] = field(default_factory=list)
    by_tier: list[dict[str, int]] = field(default_factory=list)


def ttft(service: EngineService, prompt: list[int]) -> tuple[float, Any]:
    """Seconds from submit to the first token, and the prefill report."""
    handle = service.submit(GenerationRequest(tuple(prompt), 1))
    _, finish = handle.result(timeout=600)
    if finish.reason == "error":
        raise RuntimeError(f"benchmark request failed: {finish.error}")
    assert handle.first_token_at is not None
    return handle.first_token_at - handle.submitted_at, finish.prefill


def on_engine(service: EngineService, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on the engine thread (the cache is that thread's alone) and wait for it."""
    return service.scheduler.call_soon(fn).result(timeout=600)


class TtftRun:
    """One benchmark run over a model; ``run()`` returns the raw samples."""

    def __init__(self, config: KvtierConfig, lm: CausalLM, plan: TtftPlan,
                 progress: Callable[[str], None] | None = None) -> None:
        self.config, self.lm, self.plan = config, lm, plan
        self.progress = progress or (lambda _label: None)
        self.rng = random.Random(plan.seed)
        self.vocab = min(int(lm.config.vocab_size), 32000)
        self.samples: dict[tuple[str, int], Samples] = {}
        self.miss: dict[int, Samples] = {}
        self.cache_rates: dict[str, Any] = {}   # group -> the rates the planner ended with
        self._pairs = 0                           # miss-path pairs taken (their order alternates)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(16, self.vocab) for _ in range(n)]

    def run(self) -> None:
        baseline = EngineService(replace(self.config, cache=replace(self.config.cache,
                                                                    enabled=False)), self.lm)
        try:
            self._warm(baseline)
            for group in self._groups():
                self._run_group(baseline, group)
            if not self._groups():
                self._recompute_only(baseline)
        finally:
            baseline.close()

    def _groups(self) -> list[str]:
        return list(dict.fromkeys(TIER_SPECS[t].group for t in self.plan.tiers if t in TIER_SPECS))

    def _group_config(self, group: str) -> KvtierConfig:
        store = self.config.store
        store = replace(store, disk_url=self.plan.disk_url if group == "disk" else "",
                        remote_url=self.plan.redis_url if group == "redis" else "")
        return replace(self.config, store=store, cache=replace(self.config.cache, enabled=True))

    def _run_group(self, baseline: EngineService, group: str) -> None:
        tiers = [t for t in self.plan.tiers if TIER_SPECS.get(t, TierSpec("")).group == group]
        service = EngineService.build(self._group_config(group), lm=self.lm)
        try:
            self._warm(service)
            for length in self.plan.prefix_tokens:
                for _ in range(self.plan.repeats):
                    self._one_prefix(baseline, service, tiers, length)
        finally:
            if service.prefix_cache is not None:
                stats = on_engine(service, service.prefix_cache.stats)
                self.cache_rates[group] = stats.get("rates")
            service.close()

    def _one_prefix(self, baseline: EngineService, service: EngineService, tiers: list[str],
                    length: int) -> None:
        prefix, suffix = self.tokens(length), self.plan.suffix_tokens
        prefix_cache = service.prefix_cache
        prompt = prefix + self.tokens(suffix)
        # the pair's order alternates: a second forward right after a first can run slower
        # (clocks, caches), which must not count against either side
        self._pairs += 1
        if self._pairs % 2:
            base_s, _ = ttft(baseline, prompt)
            miss_s, _ = ttft(service, prompt)
        else:
            miss_s, _ = ttft(service, prompt)
            base_s, _ = ttft(baseline, prompt)
        self._add(self.miss.setdefault(length, Samples()), miss_s, base_s, None)
        self._add(self.samples.setdefault(("recompute", length), Samples()), base_s, base_s, None)
        self.progress(f"{length} miss")
        for tier in tiers:
            spec = TIER_SPECS[tier]
            on_engine(service, lambda drop=spec.drop: prefix_cache.drop_tiers(drop))
            if spec.cold_disk:
                drop_page_cache(self.plan.disk_url, whole_machine=self.plan.whole_machine_drop)
            on_engine(service, lambda split=spec.split: setattr(prefix_cache, "split", split))
            hit_prompt = prefix + self.tokens(suffix)
            hit_s, report = ttft(service, hit_prompt)
            base_s, _ = ttft(baseline, hit_prompt)
            self._add(self.samples.setdefault((tier, length), Samples()), hit_s, base_s, report)
            self.progress(f"{length} {tier}")
        on_engine(service, prefix_cache.settle)

    def _recompute_only(self, baseline: EngineService) -> None:
        for length in self.plan.prefix_tokens:
            for _ in range(self.plan.repeats):
                prompt = self.tokens(length + self.plan.suffix_tokens)
                base_s, _ = ttft(baseline, prompt)
                self._add(self.samples.setdefault(("recompute", length), Samples()),
                          base_s, base_s, None)
                self.progress(f"{length} recompute")

    @staticmethod
    def _add(samples: Samples, hit_s: float, base_s: float, report: Any) -> None:
        samples.hit.append(hit_s)
        samples.recompute.append(base_s)
        if report is not None:
            samples.cached_tokens.append(report.cached_tokens)
            samples.recomputed_hit_tokens.append(report.recomputed_hit_tokens)
            samples.by_tier.append(dict(report.cached_by_tier))

    def _warm(self, service: EngineService) -> None:
        """Compile kernels, fill allocators and walk every load path once before timing, at
        every measured length (kernels are specialized on sizes: a first compile must not
        land in a timed sample)."""
        ttft(service, self.tokens(64))
        cache = service.prefix_cache
        for length in self.plan.prefix_tokens:
            prefix = self.tokens(length)
            ttft(service, prefix + self.tokens(self.plan.suffix_tokens))
            ttft(service, prefix + self.tokens(self.plan.suffix_tokens))  # a device hit
            if cache is None:
                continue
            for drop in (("device",), ("device", "host")):
                on_engine(service, lambda d=drop: cache.drop_tiers(d))
                ttft(service, prefix + self.tokens(self.plan.suffix_tokens))
            on_engine(service, cache.settle)

    def steps(self) -> int:
        """How many progress steps ``run`` reports."""
        per_length = self.plan.repeats * len(self.plan.prefix_tokens)
        groups = self._groups()
        if not groups:
            return per_length
        return per_length * (len(groups) + sum(t in TIER_SPECS for t in self.plan.tiers))


def summarize(run: TtftRun) -> dict[str, Any]:
    """Medians per tier and length, ratios to recompute, and the miss-path overhead."""
    rows = []
    for (tier, length), s in sorted(run.samples.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        hit, base = statistics.median(s.hit), statistics.median(s.recompute)
        rows.append({"tier": tier, "prefix_tokens": length, "ttft_s": hit,
                     "recompute_s": base, "ratio_to_recompute": hit / base,
                     "speedup": base / hit, "ttft_s_all": s.hit, "recompute_s_all": s.recompute,
                     "cached_tokens": _median_int(s.cached_tokens),
                     "recomputed_hit_tokens": _median_int(s.recomputed_hit_tokens),
                     "cached_by_tier": s.by_tier[-1] if s.by_tier else None})
    miss = []
    for length, s in sorted(run.miss.items()):
        on, off = statistics.median(s.hit), statistics.median(s.recompute)
        miss.append({"prefix_tokens": length, "kvtier_on_s": on, "no_cache_s": off,
                     "overhead": on / off - 1.0, "kvtier_on_s_all": s.hit,
                     "no_cache_s_all": s.recompute})
    return {"rows": rows, "miss_path": miss, "planner_rates": run.cache_rates}


def _median_int(values: list[int]) -> int | None:
    return int(statistics.median(values)) if values else None


def _plan(config: KvtierConfig, tiers: Sequence[str], prefix_tokens: Sequence[int],
          repeats: int, suffix_tokens: int, whole_machine_drop: bool, scratch: Path) -> TtftPlan:
    from kvtier.errors import ConfigError

    for tier in tiers:
        if tier not in TIER_NAMES:
            raise ConfigError("--tiers", tier, ", ".join(TIER_NAMES))
    if any(t.startswith("redis") for t in tiers) and not config.store.remote_url:
        raise ConfigError("--redis", "", "a redis:// URL when a redis tier is measured")
    disk_url = config.store.disk_url or f"file://{scratch}/disk"
    return TtftPlan(tuple(prefix_tokens), tuple(tiers), repeats, suffix_tokens,
                    config.engine.seed, disk_url, config.store.remote_url, whole_machine_drop)


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="ttft", unit="run")


def run_ttft(config: KvtierConfig, *, tiers: Sequence[str], prefix_tokens: Sequence[int],
             repeats: int, suffix_tokens: int, cold_disk: str, progress: bool) -> dict[str, Any]:
    """Load the model of ``config`` and measure every tier of ``tiers`` (``TIER_NAMES``) at
    every length of ``prefix_tokens``; the summary, with the goals and the setup. A disk tier
    without ``store.disk_url`` goes to a scratch directory, removed afterwards. ``cold_disk``:
    ``fadvise`` (the store's files) or ``drop_caches`` (the whole machine, root). Ctrl-C ends
    the run early and keeps what was measured (``interrupted`` true)."""
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-ttft-"))
    try:
        plan = _plan(config, tiers, prefix_tokens, repeats, suffix_tokens,
                     cold_disk == "drop_caches", scratch)
        lm = load_model(config.engine.model, device=config.engine.device,
                        dtype=config.engine.dtype, seed=config.engine.seed,
                        attention=config.engine.attention,
                        deterministic=config.engine.deterministic,
                        prefill_attention=config.engine.prefill_attention)
        bench = TtftRun(config, lm, plan)
        bar = _progress(bench.steps(), progress)
        if bar is not None:
            bench.progress = lambda label: (bar.set_postfix_str(label), bar.update(1))
        interrupted = False
        try:
            bench.run()
        except KeyboardInterrupt:  # keep what was measured (SIGINT, e.g. from `timeout -s INT`)
            interrupted = True
        if bar is not None:
            bar.close()
        summary = summarize(bench)
        summary["interrupted"] = interrupted
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary["goals"] = goals(summary)
    summary["setup"] = {"model": lm.name, "device": str(lm.device), "dtype": lm.dtype_name,
                        "page_size": config.cache.page_size, "repeats": plan.repeats,
                        "suffix_tokens": plan.suffix_tokens, "tiers": list(plan.tiers),
                        "prefix_tokens": list(plan.prefix_tokens),
                        "host_pool_bytes": config.host.pool_bytes,
                        "cold_disk": cold_disk,
                        "prefetch_policy": config.controller.prefetch_policy,
                        "fingerprint": lm.fingerprint}
    return summary
