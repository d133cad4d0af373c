"""kvtier's connector counters inside vLLM's own metrics: its periodic log line and Prometheus.

Owns ``KvtierConnectorStats`` (a ``KVConnectorStats``: the counters that moved since the last
report, summed over reports and ranks), ``CounterReport`` (which of the runtime's counters moved
since it last asked) and ``KvtierPromMetrics`` (one Prometheus counter per exported counter and
vLLM engine, named ``vllm:kvtier_<counter>_total``). vLLM asks the connector for stats after
every step (scheduler half: ``get_kv_connector_stats``; a worker in a process of its own reports
its own counters the same way), sends them to its stat loggers, logs the sum over each
logging interval as ``KV Transfer metrics: ...`` and feeds ``observe`` with each report.

``EXPORTED`` says what goes out: hits by the tier that served them, tokens claimed, refused
and unverified, lookups deferred while a store's part landed, saves made, skipped, dropped
and refused, load errors. Runs on vLLM's scheduling loop (reports, Prometheus observe) and its
logging thread (reduce).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

#: The counters of ``ConnectorRuntime.counts`` (and its saver's) exported, with their help text.
EXPORTED: dict[str, str] = {
    "hit_tokens_device": "Prompt tokens served from kvtier's device tier (its staging pages).",
    "hit_tokens_host": "Prompt tokens served from kvtier's host tier.",
    "hit_tokens_disk": "Prompt tokens served from kvtier's disk tier.",
    "hit_tokens_remote": "Prompt tokens served from kvtier's remote (Redis) tier.",
    "claimed_tokens": "Prompt tokens vLLM loaded from kvtier instead of computing them.",
    "lookups": "Prompts looked up in kvtier.",
    "matched_tokens": "Prompt tokens kvtier's index held for the prompts looked up.",
    "unverified_or_missing_tokens": "Matched tokens whose pages failed verification or were gone.",
    "lookups_deferred_landing": "Lookups deferred a step while a store's pages landed.",
    "store_tokens_declined_slower": "Matched tokens only a store held, left to vLLM to compute: "
                                    "reading them was measured slower than computing them.",
    "requests_refused_model_kv": "Requests kvtier stayed out of (KV it cannot restore exactly).",
    "requests_opted_out": "Requests that opted out of kvtier (kv_transfer_params).",
    "load_errors": "Loads whose staged pages were gone (vLLM recomputed their blocks).",
    "load_layers_missed": "Layers of loads a forward ran without (never expected; logged).",
    "saved_tokens": "Prompt tokens stored into kvtier.",
    "saves_skipped_held": "Prompt saves skipped: kvtier held every page already.",
    "saves_dropped_queue_full": "Prompt saves dropped: the save queue was full.",
    "saves_refused_no_staging": "Prompt saves refused: no free staging page.",
    "saves_refused_evicted": "Prompt saves refused: a reused staging page was evicted.",
    "saves_to_host_only": "Prompt saves of only the pages past a head held on host, to host.",
    "saves_refused_host_moved": "Prompt saves to host refused: the host tier lost their head.",
    "saves_refused_no_host_room": "Prompt saves refused on the direct path: no host page free.",
    "saves_incomplete": "Prompt saves abandoned with layers not copied.",
    "saves_failed": "Prompt saves that raised (logged).",
    # The connector's CPU time inside vLLM's engine loop (microseconds): what it adds to a step.
    "lookup_us": "Scheduler: time looking prompts up (get_num_new_matched_tokens), us.",
    "meta_build_us": "Scheduler: time building each step's connector metadata, us.",
    "worker_hooks_us": "Model runner: time in the connector's step hooks (loads, saves), us.",
    "save_plan_cpu_us": "Model runner: CPU time planning saves (index match, staging pages), us.",
    "save_copy_cpu_us": "Model runner: CPU time launching saves' layer copies, us.",
    "save_commit_cpu_us": "Model runner: CPU time committing saves to the cache, us.",
}


def counters_of(runtime: Any) -> Counter[str]:
    """The runtime's counters and its saver's, if it has one."""
    counts = Counter(runtime.counts)
    saver = getattr(runtime, "saver", None)
    if saver is not None:
        counts.update(saver.counts)
    return counts


class CounterReport:
    """What moved among ``EXPORTED`` counters of ``runtime`` since the last ``take``."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self._last: Counter[str] = Counter()

    def take(self) -> dict[str, int]:
        now = counters_of(self.runtime)
        moved = {name: now[name] - self._last[name] for name in EXPORTED
                 if now[name] != self._last[name]}
        self._last = Counter({name: now[name] for name in EXPORTED})
        return moved


@dataclass
class KvtierConnectorStats(KVConnectorStats):
    """Counter increments since the last report (``data``: name -> increment)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = Counter(self.data)
        merged.update(other.data or {})
        self.data = dict(merged)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: int(value) for name, value in sorted(self.data.items()) if value}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvtierPromMetrics(KVConnectorPromMetrics):
    """One counter per ``EXPORTED`` name and engine, fed with each step's increments."""

    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, help_text in EXPORTED.items():
            metric = self._counter_cls(name=f"vllm:kvtier_{name}", documentation=help_text,
                                       labelnames=labelnames)
            self._counters[name] = {engine: metric.labels(*values)
                                    for engine, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in (transfer_stats_data or {}).items():
            counter = self._counters.get(name, {}).get(engine_idx)
            if counter is not None and value > 0:
                counter.inc(value)
