"""Prometheus text from component ``stats()`` snapshots: the only module importing prometheus_client.

Owns ``render_metrics(snapshot) -> bytes`` and ``CONTENT_TYPE``. The snapshot is plain data that
the caller gathers (the server's ``/metrics`` route does so on the engine thread)::

    {"info": {"version", "model"}, "requests": RequestStats.snapshot(),
     "scheduler": Scheduler.stats(), "cache": TieredCache.stats() or None (with
     "store_health": the store guards' states),
     "http": RequestLimits counters, "process": process_snapshot(),
     "bindings": BindingTable.stats()}

(``kvtier.metrics_server`` renders the server's and the process's own families, the one other
module importing prometheus_client.)

Any part may be missing (the cache is off, the engine did not answer in time); its series are
then left out, except the request and scheduler counters, which start at zero. Every series is
named ``kvtier_*`` (plus ``prompt_tokens_cached_by_source_total``, the name routers read, beside
``kvtier_cached_tokens_total``); store series carry the tier and the backend, so two tiers on one
backend stay apart. Nothing is registered globally: each call builds a private registry, so rendering is
a pure function of the snapshot. Any thread.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kvtier.metrics_server import server_families

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TIERS = ("device", "host", "disk", "remote")

Snapshot = Mapping[str, Any]


def render_metrics(snapshot: Snapshot) -> bytes:
    """The snapshot in the Prometheus text exposition format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snapshot))
    return generate_latest(registry)


class _SnapshotCollector:
    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        yield from _info(snap.get("info") or {})
        yield from _requests(snap.get("requests") or {})
        yield from _scheduler(snap.get("scheduler") or {}, snap.get("http") or {})
        yield from server_families(snap.get("http") or {}, snap.get("process") or {})
        cache = snap.get("cache")
        yield _gauge("kvtier_cache_stats_ok", "1 when this scrape holds the cache's snapshot, 0 "
                     "when the cache is off or the engine did not answer in time.",
                     [((), 1 if cache else 0)])
        if cache:
            yield from _cache(cache)
            yield from _stores(cache.get("stores") or {})
            yield from _store_health(cache.get("store_health") or {})
            yield from _memory(cache)
            yield _write_refused(cache)
        yield from _bindings(snap.get("bindings") or {})
        if snap.get("kv_events"):
            yield from _kv_events(snap["kv_events"])


# ---- family helpers -------------------------------------------------------------------------
Rows = list[tuple[tuple[str, ...], float]]


def _counter(name: str, doc: str, rows: Rows, labels: tuple[str, ...] = ()) -> Metric:
    family = CounterMetricFamily(name, doc, labels=list(labels))
    for values, value in rows:
        family.add_metric(list(values), float(value))
    return family


def _gauge(name: str, doc: str, rows: Rows, labels: tuple[str, ...] = ()) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    for values, value in rows:
        family.add_metric(list(values), float(value))
    return family


def _histogram(name: str, doc: str, hist: Mapping[str, Any]) -> Metric:
    bounds, counts = list(hist.get("bounds") or []), list(hist.get("counts") or [0])
    buckets, running = [], 0
    for bound, count in zip([*bounds, "+Inf"], counts, strict=True):
        running += count
        buckets.append((_le(bound), running))
    family = HistogramMetricFamily(name, doc, labels=[])
    family.add_metric([], buckets, float(hist.get("sum", 0.0)))
    return family


def _le(bound: Any) -> str:
    return bound if isinstance(bound, str) else repr(float(bound))


def _by_key(values: Mapping[str, Any] | None) -> Rows:
    return [((str(k),), v) for k, v in sorted((values or {}).items()) if _number(v)]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---- sections -------------------------------------------------------------------------------
def _info(info: Mapping[str, Any]) -> Iterator[Metric]:
    family = GaugeMetricFamily("kvtier_build_info", "kvtier version and the model served.",
                               labels=["version", "model"])
    family.add_metric([str(info.get("version", "")), str(info.get("model", ""))], 1.0)
    yield family


def _requests(req: Mapping[str, Any]) -> Iterator[Metric]:
    yield _counter("kvtier_requests_total", "Requests ended, by outcome (stop, length, "
                   "cancelled, error).", _by_key(req.get("requests_total")), ("outcome",))
    for key, doc in (("prompt_tokens_total", "Prompt tokens of requests that reached prefill."),
                     ("computed_tokens_total", "Prompt tokens the model computed (not served by "
                      "the cache)."),
                     ("recomputed_hit_tokens_total", "Cached prompt tokens recomputed on purpose "
                      "(the head of a hit, while its tail loads)."),
                     ("completion_tokens_total", "Tokens generated.")):
        yield _counter(f"kvtier_{key}", doc, [((), req.get(key, 0))])
    cached = req.get("cached_tokens_total") or dict.fromkeys(TIERS, 0)
    yield _counter("kvtier_cached_tokens_total", "Prompt tokens served from the cache, by the "
                   "tier they came from.", _by_key(cached), ("tier",))
    yield _counter("prompt_tokens_cached_by_source_total", "The same count under the name "
                   "routers and dashboards read: prompt tokens served from the cache, by source "
                   "tier.", _by_key(cached), ("source",))
    for key, name, doc in (
            ("ttft_seconds", "kvtier_time_to_first_token_seconds", "Time from a request's "
             "arrival at the engine to its first token."),
            ("queue_seconds", "kvtier_queue_wait_seconds", "Time a request waited in the queue."),
            ("prefill_seconds", "kvtier_prefill_seconds", "Time a prefill took (cache match, "
             "load and compute)."),
            ("e2e_seconds", "kvtier_e2e_request_latency_seconds", "Time from a request's "
             "arrival at the engine to its end."),
            ("token_gap_seconds", "kvtier_inter_token_latency_seconds", "Time between two "
             "consecutive tokens of a request.")):
        yield _histogram(name, doc, req.get(key) or {})


def _kv_events(feed: Mapping[str, Any]) -> Iterator[Metric]:
    rec, pub = feed.get("recorder") or {}, feed.get("publisher") or {}
    yield _counter("kvtier_kv_events_total", "KV events by fate: recorded on the engine thread, "
                   "dropped (the oldest, when the queue was full), published on ZMQ.",
                   [(("recorded",), rec.get("put_total", 0)),
                    (("dropped",), rec.get("dropped_total", 0)),
                    (("published",), pub.get("events", 0))], ("outcome",))
    yield _counter("kvtier_kv_event_batches_total", "KV event batches published (sequence numbers "
                   "used).", [((), pub.get("batches", 0))])
    yield _counter("kvtier_kv_event_replays_total", "Replay requests, by outcome.",
                   [(("served",), pub.get("replay_requests", 0)),
                    (("invalid",), pub.get("replay_invalid", 0))], ("outcome",))


def _scheduler(sched: Mapping[str, Any], http: Mapping[str, Any]) -> Iterator[Metric]:
    yield _gauge("kvtier_requests_queued", "Requests waiting for the engine.",
                 [((), sched.get("queued", 0))])
    yield _gauge("kvtier_requests_running", "Requests the engine is generating.",
                 [((), sched.get("running", 0))])
    rejected = {"queue_full": sched.get("rejected", 0),
                **{k: v for k, v in (http.get("rejected_total") or {}).items()}}
    yield _counter("kvtier_requests_rejected_total", "Requests refused before any work, by "
                   "reason (queue_full, too_many_in_flight, body_too_large).", _by_key(rejected),
                   ("reason",))
    yield _gauge("kvtier_http_requests_in_flight", "HTTP requests being served (operator "
                 "routes excluded).", [((), http.get("in_flight", 0))])
    errors = [((str(e["status"]), str(e["reason"])), e["count"])
              for e in http.get("errors_total") or [] if _number(e.get("count"))]
    yield _counter("kvtier_http_errors_total", "4xx answers by status and reason (the error "
                   "code: invalid_json, unknown_parameter, model_not_found, body_too_large, "
                   "...).", errors, ("status", "reason"))
    for key, name, doc in (("steps", "kvtier_engine_steps_total", "Batched forwards run."),
                           ("batched_tokens", "kvtier_engine_batched_tokens_total",
                            "Tokens run by batched forwards (decodes and prefill chunks)."),
                           ("preempted", "kvtier_engine_preempted_total",
                            "Sequences preempted because the device pool ran out."),
                           ("ahead_steps", "kvtier_engine_ahead_steps_total",
                            "Greedy decode steps queued one step ahead (engine.decode_ahead)."),
                           ("ahead_rows_taken", "kvtier_engine_ahead_rows_taken_total",
                            "Rows of steps queued ahead that the next step took."),
                           ("ahead_rows_dropped", "kvtier_engine_ahead_rows_dropped_total",
                            "Rows of steps queued ahead that the next step could not take "
                            "(their sequence ended or changed; computed again if needed).")):
        yield _counter(name, doc, [((), sched.get(key, 0))])


def _cache(cache: Mapping[str, Any]) -> Iterator[Metric]:
    tiers = cache.get("tiers") or {}
    for field, name, doc in (("pages", "kvtier_pages", "Pages the index holds on each tier."),
                             ("protected", "kvtier_pages_protected", "Pages locked by requests "
                              "or copies in flight (not evictable)."),
                             ("free", "kvtier_pages_free", "Free page slots of a pool tier.")):
        rows = [((t,), v[field]) for t, v in tiers.items() if _number(v.get(field))]
        yield _gauge(name, doc, rows, ("tier",))
    yield _gauge("kvtier_index_nodes", "Nodes of the radix index.",
                 [((), (cache.get("index") or {}).get("nodes", 0))])
    counters = cache.get("counters") or {}
    yield _counter("kvtier_hit_tokens_total", "Prompt tokens found by lookups, by the fastest "
                   "tier holding them.", _by_key(counters.get("hit_tokens_total")), ("tier",))
    yield _counter("kvtier_prefetch_total", "Prefetches (store to host), by outcome.",
                   _by_key(counters.get("prefetch_total")), ("outcome",))
    backups = counters.get("backup_total") or {}
    rows = [((tier, outcome), n) for tier, by in sorted(backups.items()) if isinstance(by, dict)
            for outcome, n in sorted(by.items())]
    yield _counter("kvtier_backup_jobs_total", "Host to store backup jobs, by tier and outcome.",
                   rows, ("tier", "outcome"))
    yield _counter("kvtier_backup_pages_total", "Pages a store confirmed after a backup.",
                   _by_key(counters.get("backup_pages_total")), ("tier",))
    yield _counter("kvtier_cache_hint_pages_total", "Prompt pages that cache hints asked to "
                   "keep longer, by outcome: applied, refused (past the tenant's share), expired.",
                   [((k,), counters.get(f"hint_pages_{k}_total", 0))
                    for k in ("applied", "refused", "expired")], ("outcome",))
    yield _counter("kvtier_cache_hint_requests_total", "Requests with a cache hint, by outcome: "
                   "hinted, ignored (no tier's eviction policy can honour hints).",
                   [(("hinted",), counters.get("hint_requests_total", 0)),
                    (("ignored",), counters.get("hint_ignored_total", 0))], ("outcome",))
    workers = cache.get("workers") or {}
    yield _gauge("kvtier_io_jobs_queued", "IO jobs waiting for a worker, by kind.",
                 [(("load",), workers.get("queued_loads", 0)),
                  (("store",), workers.get("queued_stores", 0))], ("kind",))
    yield _counter("kvtier_io_jobs_total", "IO jobs by state (submitted, refused, completed).",
                   [((k,), workers.get(k, 0)) for k in ("submitted", "refused", "completed")],
                   ("state",))


def _stores(stores: Mapping[str, Mapping[str, Any]]) -> Iterator[Metric]:
    labels = ("tier", "backend")
    rows: dict[str, Rows] = {k: [] for k in ("bytes", "errors", "reads", "evicted", "dropped",
                                             "recovered", "corrupt", "used", "pages",
                                             "capacity")}
    for tier, st in sorted(stores.items()):
        who = (tier, str(st.get("backend", "")))
        rows["bytes"] += [((*who, "read"), st.get("bytes_read", 0)),
                          ((*who, "write"), st.get("bytes_written", 0))]
        rows["errors"] += [((*who, kind), st.get(field, 0)) for kind, field in
                           (("io", "errors"), ("corrupt", "corrupt"), ("refused", "refused"))]
        rows["reads"] += [((*who, "hit"), st.get("hits", 0)), ((*who, "miss"), st.get("misses", 0))]
        rows["evicted"].append((who, st.get("evicted", 0)))
        rows["dropped"].append((who, st.get("dropped", 0)))
        rows["recovered"] += [((*who, "recovered"), st.get("recovered", 0)),
                              ((*who, "skipped"), st.get("recovery_skipped", 0))]
        rows["corrupt"].append(((tier,), st.get("corrupt", 0)))
        rows["used"].append((who, st.get("bytes", 0)))
        rows["pages"].append((who, st.get("pages", 0)))
        if _number(st.get("capacity_bytes")):
            rows["capacity"].append((who, st["capacity_bytes"]))
    yield _counter("kvtier_store_bytes_total", "Page bytes moved to and from a store.",
                   rows["bytes"], (*labels, "direction"))
    yield _counter("kvtier_store_errors_total", "Store failures by kind: io (outage, disk "
                   "error), corrupt (failed verification), refused (write not taken).",
                   rows["errors"], (*labels, "kind"))
    yield _counter("kvtier_store_reads_total", "Pages asked of a store, by result.",
                   rows["reads"], (*labels, "result"))
    yield _counter("kvtier_store_evicted_pages_total", "Pages a store evicted to stay under "
                   "its cap.", rows["evicted"], labels)
    yield _counter("kvtier_store_dropped_pages_total", "Pages a store removed because they "
                   "failed verification; the next write stores them again.", rows["dropped"],
                   labels)
    yield _counter("kvtier_store_recovered_records_total", "Records a disk store re-indexed "
                   "from its segments after its index was lost (recovered), and those it "
                   "skipped (torn, corrupt, another format; never served).", rows["recovered"],
                   (*labels, "outcome"))
    yield _counter("kvtier_page_corrupt_total", "Pages that failed verification on read (never "
                   "served).", rows["corrupt"], ("tier",))
    yield _gauge("kvtier_store_used_bytes", "Bytes a store holds.", rows["used"], labels)
    yield _gauge("kvtier_store_pages", "Pages a store holds.", rows["pages"], labels)
    yield _gauge("kvtier_store_capacity_bytes", "A store's byte cap.", rows["capacity"], labels)


def _store_health(health: Mapping[str, Mapping[str, Any]]) -> Iterator[Metric]:
    up: Rows = []
    degraded: Rows = []
    problems: Rows = []
    events: Rows = []
    for tier, h in sorted(health.items()):
        up.append(((tier, str(h.get("backend", ""))), 0 if h.get("state") == "off" else 1))
        degraded += [((tier, str(reason)), 1) for reason in sorted(h.get("problems") or {})]
        problems += [((tier, str(r)), n) for r, n in sorted((h.get("problems_total") or {}).items())
                     if _number(n)]
        events += [((tier, str(e)), n) for e, n in sorted((h.get("events_total") or {}).items())
                   if _number(n)]
    yield _gauge("kvtier_store_up", "1 while a store tier serves (on or degraded), 0 while it is "
                 "off: it could not be opened or was lost, and is retried in the background.",
                 up, ("tier", "backend"))
    yield _gauge("kvtier_store_degraded", "1 per problem a store tier has now, by reason "
                 "(unavailable, corrupt, foreign, config: off; unreachable, gone, full, "
                 "io_errors, corrupt_pages: degraded).", degraded, ("tier", "reason"))
    yield _counter("kvtier_store_problems_total", "Store problems seen, by reason: failed "
                   "opens, and checks (every 2 s) that found new evidence of one.", problems,
                   ("tier", "reason"))
    yield _counter("kvtier_store_events_total", "Store tier events: opened, open_failed, "
                   "set_aside (a damaged directory moved aside), lost (its pages gone: a "
                   "restart empty, a directory removed).", events, ("tier", "event"))


def _write_refused(cache: Mapping[str, Any]) -> Metric:
    rows: Rows = [(("store", tier), st.get("refused", 0))
                  for tier, st in sorted((cache.get("stores") or {}).items())]
    staging = (cache.get("counters") or {}).get("backup_refused_total") or {}
    rows += [(("staging", tier), n) for tier, n in sorted(staging.items()) if _number(n)]
    return _counter("kvtier_write_refused_total", "Page writes refused, by reason (store: the "
                    "store did not take them; staging: a backup put off for want of staging "
                    "room or IO queue space) and store tier.", rows, ("reason", "tier"))


def _memory(cache: Mapping[str, Any]) -> Iterator[Metric]:
    pinned = cache.get("pinned") or {}
    owners = pinned.get("owners") or {}
    yield _gauge("kvtier_pinned_bytes", "Pinned host bytes held, by owner.",
                 [((o,), v.get("bytes", 0)) for o, v in sorted(owners.items())], ("owner",))
    yield _gauge("kvtier_pinned_limit_bytes", "The pinned host byte budget.",
                 [((), pinned.get("limit_bytes", 0))])
    yield _counter("kvtier_pinned_refused_total", "Pinned reservations refused by the budget.",
                   [((), pinned.get("refused_total", 0))])
    ring = cache.get("read_ring") or {}
    yield _counter("kvtier_read_ring_overflow_total", "Store reads that found no free read-ring "
                   "slot and used a pageable buffer (0 while reads land in host pages directly).",
                   [((), ring.get("overflow_total", 0))])
    admission = cache.get("write_admission") or {}
    yield _gauge("kvtier_write_staging_pages", "Host pages charged to store writes in flight, "
                 "and the bound.", [(("used",), admission.get("used_pages", 0)),
                                    (("capacity",), admission.get("capacity_pages", 0))],
                 ("state",))
    selection = cache.get("write_selection") or {}
    if selection:
        rate = selection.get("fresh_return_rate")
        yield _gauge("kvtier_write_selective_fresh_return_rate", "write_through_selective: the "
                     "decayed share of probed fresh pages a later request read again (fresh "
                     "pages are copied down while it is at least 1/2; -1 until enough probes "
                     "are resolved).", [((), rate if _number(rate) else -1)])
        yield _counter("kvtier_write_selective_fresh_pages_total", "Fresh pages "
                       "write_through_selective copied down because they were returning.",
                       [((), selection.get("fresh_admitted_pages", 0))])
    copy = cache.get("copy") or {}
    yield _counter("kvtier_copy_bytes_total", "Bytes copied between device and host pools.",
                   [((d,), copy.get(f"{d}_bytes", 0)) for d in ("load", "store")], ("direction",))


def _bindings(bindings: Mapping[str, Any]) -> Iterator[Metric]:
    slots = bindings.get("slots") or {}
    labels = ("slot",)
    yield _gauge("kvtier_binding_generation", "Generation of what each slot (host pool, store "
                 "tiers) is bound to; it grows on every swap.",
                 [((s,), v.get("generation", 0)) for s, v in sorted(slots.items())], labels)
    yield _gauge("kvtier_tier_disabled", "1 when a slot is disabled after a failed swap.",
                 [((s,), 1 if v.get("disabled") else 0) for s, v in sorted(slots.items())], labels)
    yield _counter("kvtier_binding_swaps_total", "Completed swaps (attach, detach, rebuild).",
                   [((s,), v.get("swaps", 0)) for s, v in sorted(slots.items())], labels)
    yield _counter("kvtier_binding_failures_total", "Swaps that failed part-way (the slot was "
                   "disabled).", [((s,), v.get("failures", 0)) for s, v in sorted(slots.items())],
                   labels)
    yield _counter("kvtier_binding_incoherent_total", "Coherence checks that found a reader "
                   "holding another generation than the slot's.",
                   [((), bindings.get("incoherent_total", 0))])
