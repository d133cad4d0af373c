"""kvtier.bench: benchmark tooling, outside the runtime (nothing in the cache, the engine or the
server imports it).

Modules: ``ttft`` (paired hit / recompute time-to-first-token runs over an ``EngineService``,
driven by ``kvtier bench ttft``), ``ttft_plot`` (its figure), ``coldcache`` (dropping a disk
store's files from the OS page cache between runs). Main thread.
"""
