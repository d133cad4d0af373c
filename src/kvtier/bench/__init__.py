"""kvtier.bench: benchmark and measurement tooling, outside the runtime (nothing in the cache,
the engine or the server imports it; the ``kvtier bench`` and ``kvtier plan --probe`` commands
and the scripts under ``benchmarks/`` do).

Modules: ``key_hashing`` (page-key hashing, ``kvtier bench keys``); ``ttft`` (paired hit /
recompute time-to-first-token runs over an ``EngineService``, ``kvtier bench ttft``),
``ttft_report`` (its goals, table and files) and ``ttft_plot`` (its figure); ``coldcache``
(dropping a disk store's files from the OS page cache between runs); ``store_throughput`` (a
page store beside a raw baseline, ``kvtier bench store``), ``page_io`` (page buffers and
threaded batches it and the baselines share), ``raw_disk`` and ``raw_redis`` (the raw
baselines); ``trace_replay`` (a trace through the index, ``kvtier bench replay``);
``serve_compare`` (a serving benchmark against running servers, ``kvtier bench serve``) with
``serve_workloads`` (its prompts), ``serve_load`` (its load generator) and ``serve_plot`` (its
figure); ``rate_probes`` (host, disk and Redis rates for ``kvtier plan --probe``). Main thread,
plus the worker threads a benchmark starts.
"""
