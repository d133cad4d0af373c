"""Radix index speed and memory: ``match`` and ``insert`` of a 128k-token prompt with ~1M pages
indexed, and index memory per page, side by side with a flat hash table keyed by page key.

The baseline is what hash-per-page prefix caches do: a dict from ``PageKey`` to a page id,
matched by probing the prompt's keys in order until the first miss (it needs the keys, so its
full cost includes hashing the prompt). The radix index compares token bytes instead, so a hit is
verified against the tokens it was computed for.

Shapes: ``tree`` (prompts sharing random-length prefixes, a few nodes per path) and
``fragmented`` (a query path of one node per page, the worst case for a radix walk).

Run: ``python benchmarks/index/bench_index.py [--pages 1048576] [--json out.json]``. Main thread.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

from kvtier.index.radix import RadixIndex
from kvtier.keys import KeyNamespace, chain_keys, page_keys
from kvtier.machine import format_table, write_report

PAGE = 64
VOCAB = 150_000


def _pcts(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return (samples[len(samples) // 2] * 1e3,
            samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1e3)


def percentile_ms(fn: Callable[[], Any], repeats: int) -> tuple[float, float, float, float]:
    """(p50, p99) of wall time and of this thread's CPU time, in ms. On a shared machine the CPU
    time is the operation's own cost; the wall time adds whatever preempted it."""
    wall, cpu = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.thread_time()
        fn()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    return (*_pcts(wall), *_pcts(cpu))


def make_corpus(target_pages: int, prompt_pages: int, seed: int = 1) -> list[tuple[np.ndarray, int]]:
    """Prompts of ``prompt_pages`` pages, each sharing a random-length prefix with an earlier
    one, until ``target_pages`` distinct pages exist; (tokens, pages shared) per prompt."""
    rng = np.random.default_rng(seed)
    out: list[tuple[np.ndarray, int]] = []
    total = 0
    while total < target_pages:
        tokens = rng.integers(0, VOCAB, prompt_pages * PAGE, dtype=np.uint32)
        shared = 0
        if out:
            other = out[int(rng.integers(len(out)))][0]
            shared = int(rng.integers(0, prompt_pages))
            tokens[:shared * PAGE] = other[:shared * PAGE]
        out.append((tokens, shared))
        total += prompt_pages - shared
    return out


def fill_index(index: RadixIndex, corpus: list[tuple[np.ndarray, int]], ns: KeyNamespace) -> None:
    for tokens, shared in corpus:
        data = tokens.tobytes()
        keys = chain_keys(data, PAGE, ns.seed())
        ids = index.allocate("device", len(keys) - shared)
        index.insert(data, keys, tier="device", ids=ids, start=shared)


def fill_table(table: dict[bytes, int], corpus: list[tuple[np.ndarray, int]],
               ns: KeyNamespace) -> None:
    next_id = 0
    for tokens, shared in corpus:
        for key in chain_keys(tokens.tobytes(), PAGE, ns.seed())[shared:]:
            table[key] = next_id
            next_id += 1


def build_fragmented(ns: KeyNamespace, prompt_pages: int) -> tuple[RadixIndex, bytes]:
    """A query prompt whose every page is its own node (each page has a sibling branch)."""
    index = RadixIndex(PAGE, capacities={"device": 2 * prompt_pages})
    rng = np.random.default_rng(2)
    query = rng.integers(0, VOCAB, prompt_pages * PAGE, dtype=np.uint32)
    data = query.tobytes()
    index.insert(data, page_keys(query, PAGE, ns), tier="device",
                 ids=index.allocate("device", prompt_pages))
    for k in range(1, prompt_pages):
        branch = query[:(k + 1) * PAGE].copy()
        branch[k * PAGE] = VOCAB + 1  # differs in page k: splits the run after page k-1
        index.insert(branch.tobytes(), tier="device", ids=index.allocate("device", 1), start=k)
    return index, data


def traced_bytes(build: Callable[[], Any]) -> int:
    """Python-heap bytes that ``build()``'s result keeps alive (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    kept = build()
    gc.collect()
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del kept
    return size


def memory_per_page(pages: int, prompt_pages: int, ns: KeyNamespace) -> dict[str, float]:
    """Heap bytes per indexed page: radix index (tokens, keys, ids) vs key table (keys, ids)."""
    corpus = make_corpus(pages, prompt_pages, seed=4)
    distinct = sum(prompt_pages - shared for _, shared in corpus)

    def radix() -> RadixIndex:
        index = RadixIndex(PAGE, capacities={"device": distinct})
        fill_index(index, corpus, ns)
        return index

    def table() -> dict[bytes, int]:
        out: dict[bytes, int] = {}
        fill_table(out, corpus, ns)
        return out

    return {"radix": traced_bytes(radix) / distinct, "key_table": traced_bytes(table) / distinct}


def run(args: argparse.Namespace) -> dict[str, Any]:
    ns = KeyNamespace("bench", "0", "bfloat16", "x", PAGE)
    load_before = os.getloadavg()[0]
    corpus = make_corpus(args.pages, args.prompt_pages)
    distinct = sum(args.prompt_pages - shared for _, shared in corpus)
    index = RadixIndex(PAGE, capacities={"device": distinct + args.prompt_pages})
    start = time.perf_counter()
    fill_index(index, corpus, ns)
    build_s = time.perf_counter() - start
    table: dict[bytes, int] = {}
    fill_table(table, corpus, ns)
    nodes = index.stats()["nodes"]
    rng = np.random.default_rng(3)
    rows: list[list[Any]] = []
    results: list[dict[str, Any]] = []

    def record(case: str, what: str, fn: Callable[[], Any]) -> None:
        add(case, what, percentile_ms(fn, args.repeats))

    def add(case: str, what: str, times: tuple[float, float, float, float]) -> None:
        rows.append([case, what, *times])
        results.append({"case": case, "op": what, "p50_ms": times[0], "p99_ms": times[1],
                        "cpu_p50_ms": times[2], "cpu_p99_ms": times[3]})

    query = corpus[int(rng.integers(len(corpus)))][0]
    qbytes, qlist, qint64 = query.tobytes(), query.tolist(), query.astype(np.int64)
    qkeys = chain_keys(qbytes, PAGE, ns.seed())
    record("tree", "radix match (token bytes)", lambda: index.match(qbytes))
    record("tree", "radix match (int64 array)", lambda: index.match(qint64))
    record("tree", "radix match (python list)", lambda: index.match(qlist))
    record("tree", "key table match (keys given)", lambda: _table_match(table, qkeys))
    record("tree", "key table match (hash + probe)",
           lambda: _table_match(table, chain_keys(qbytes, PAGE, ns.seed())))
    add("tree", "radix insert (new tail)", insert_ms(index, ns, query, rng, args.repeats))
    frag_index, frag = build_fragmented(ns, args.prompt_pages)
    record("fragmented", "radix match (token bytes)", lambda: frag_index.match(frag))
    memory = memory_per_page(args.memory_pages, args.prompt_pages, ns)
    print(f"indexed {index.sizes('device').resident} pages in {nodes} nodes "
          f"({len(corpus)} prompts of {args.prompt_pages} pages) in {build_s:.1f} s")
    print(format_table(["shape", "operation", "p50 ms", "p99 ms", "cpu p50 ms", "cpu p99 ms"],
                       rows))
    print(format_table(["index", "bytes/page"], [[k, v] for k, v in memory.items()]))
    return {"page_size": PAGE, "prompt_tokens": args.prompt_pages * PAGE,
            "indexed_pages": index.sizes("device").resident, "nodes": nodes,
            "build_s": build_s, "repeats": args.repeats, "runs": results,
            "memory_bytes_per_page": memory, "memory_pages": args.memory_pages,
            "load_avg_1m_before": load_before, "load_avg_1m_after": os.getloadavg()[0],
            "goal": {"match_p99_ms": 2.0}}


def _table_match(table: dict[bytes, int], keys: list[bytes]) -> int:
    for i, key in enumerate(keys):
        if key not in table:
            return i
    return len(keys)


def insert_ms(index: RadixIndex, ns: KeyNamespace, query: np.ndarray, rng: np.random.Generator,
              repeats: int) -> tuple[float, float, float, float]:
    """Time ``insert`` of prompts sharing a random prefix of ``query`` (keys hashed and page ids
    allocated untimed); each new tail is dropped again so the index keeps its size."""
    pages = len(query) // PAGE
    wall, cpu = [], []
    for _ in range(repeats):
        shared = int(rng.integers(1, pages))
        tokens = query.copy()
        tokens[shared * PAGE:] = rng.integers(0, VOCAB, (pages - shared) * PAGE, dtype=np.uint32)
        data = tokens.tobytes()
        keys = chain_keys(data, PAGE, ns.seed())
        ids = index.allocate("device", pages - shared)
        w0, c0 = time.perf_counter(), time.thread_time()
        result = index.insert(data, keys, tier="device", ids=ids, start=shared)
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
        if result.node is not None and result.taken:
            index.drop(result.node, "device")
    return (*_pcts(wall), *_pcts(cpu))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=1 << 20, help="Pages to index.")
    parser.add_argument("--prompt-pages", type=int, default=2048, help="Pages per prompt "
                        "(2048 x 64 tokens = 128k tokens).")
    parser.add_argument("--memory-pages", type=int, default=1 << 17,
                        help="Pages indexed for the memory measurement (traced, slower).")
    parser.add_argument("--repeats", type=int, default=200, help="Timed repeats per operation.")
    parser.add_argument("--json", metavar="OUT", help="Write results as JSON here.")
    args = parser.parse_args()
    data = run(args)
    if args.json:
        write_report(args.json, "index", data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
