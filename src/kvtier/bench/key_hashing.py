"""The key hashing benchmark behind ``kvtier bench keys``: page-key hashing of long prompts.

Owns ``run``: for each page size, the median milliseconds to hash one prompt's page keys from a
Python list and from a numpy array (engines usually hold token ids in an array), beside the
bare SHA-256 chain cost; prints the table and writes JSON with machine info. Main thread.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.keys import KeyNamespace, chain_keys, page_keys, token_bytes
from kvtier.machine import format_table, write_report


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e3


def run(tokens: int, page_sizes: Sequence[int], repeats: int, json_path: str | None) -> int:
    """Time a prompt of ``tokens`` random ids at each page size (median of ``repeats``); prints
    the table, writes JSON to ``json_path``. Returns the exit status (0)."""
    import numpy as np

    rng = random.Random(0)
    prompt = [rng.randrange(150_000) for _ in range(tokens)]
    array = np.asarray(prompt, dtype=np.int64)
    rows, runs = [], []
    for page_size in page_sizes:
        ns = KeyNamespace("bench", "0", "bfloat16", "x", page_size)
        seed, data = ns.seed(), token_bytes(prompt)
        from_list = _median_ms(lambda ps=page_size, n=ns: page_keys(prompt, ps, n), repeats)
        from_array = _median_ms(lambda ps=page_size, n=ns: page_keys(array, ps, n), repeats)
        chain = _median_ms(lambda ps=page_size, s=seed, d=data: chain_keys(d, ps, s), repeats)
        pages = tokens // page_size
        runs.append({"page_size": page_size, "pages": pages, "tokens": tokens,
                     "ms_from_list": from_list, "ms_from_numpy": from_array,
                     "ms_chain_only": chain, "us_per_page": chain * 1e3 / max(pages, 1)})
        rows.append([page_size, pages, from_list, from_array, chain, chain * 1e3 / max(pages, 1)])
    print(format_table(["page_size", "pages", "ms(list)", "ms(numpy)", "ms(chain)", "us/page"], rows))
    if json_path:
        write_report(json_path, "keys", {"hash": "sha256", "runs": runs})
    return 0
