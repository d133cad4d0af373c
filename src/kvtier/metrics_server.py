"""Prometheus families of the HTTP server and its process, from plain snapshots.

Owns ``server_families(http, process)``, which ``kvtier.metrics`` adds to every scrape: 5xx
answers by route, clients that left before their answer, open connections (from
``LimitCounters.snapshot()``), and the process's resident memory and open file descriptors
(from ``serve.process_stats.process_snapshot()``; left out where the platform does not tell).
Any thread; a pure function of its arguments.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


def server_families(http: Mapping[str, Any], process: Mapping[str, Any]) -> Iterator[Metric]:
    errors = CounterMetricFamily("kvtier_http_server_errors_total", "5xx answers by route (the "
                                 "path template that answered; unmatched when none did) and "
                                 "status.", labels=["route", "status"])
    for row in http.get("server_errors_total") or []:
        errors.add_metric([str(row["route"]), str(row["status"])], float(row["count"]))
    yield errors
    gone = CounterMetricFamily("kvtier_http_client_disconnects_total", "Clients that left "
                               "before their answer was whole, by phase: body (while sending "
                               "it), response (while it was generated or streamed).",
                               labels=["phase"])
    for phase in ("body", "response"):
        gone.add_metric([phase], float((http.get("disconnects_total") or {}).get(phase, 0)))
    yield gone
    yield _gauge("kvtier_http_connections_open", "Client connections open now.",
                 http.get("connections_open", 0))
    if "resident_memory_bytes" in process:
        yield _gauge("process_resident_memory_bytes", "Resident memory of the server process.",
                     process["resident_memory_bytes"])
    if "open_fds" in process:
        yield _gauge("process_open_fds", "File descriptors the server process holds open "
                     "(sockets included).", process["open_fds"])
    if "max_fds" in process:
        yield _gauge("process_max_fds", "The process's limit on open file descriptors.",
                     process["max_fds"])


def _gauge(name: str, doc: str, value: Any) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=[])
    family.add_metric([], float(value))
    return family
