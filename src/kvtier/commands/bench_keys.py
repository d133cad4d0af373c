"""``kvtier bench keys``: time page-key hashing for long prompts at several page sizes.

Reports milliseconds per prompt from a Python list and from a numpy array (engines usually hold
token ids in an array), beside the bare SHA-256 chain cost. Main thread.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from kvtier.keys import KeyNamespace, chain_keys, page_keys, token_bytes
from kvtier.machine import format_table, write_report


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("keys", help="Time page-key hashing.")
    parser.add_argument("--tokens", type=int, default=131072, help="Prompt length in tokens.")
    parser.add_argument("--page-sizes", default="16,32,64,128,256",
                        help="Comma-separated page sizes.")
    parser.add_argument("--repeats", type=int, default=20, help="Timed repeats (median taken).")
    parser.add_argument("--json", metavar="OUT", help="Write results as JSON here.")
    parser.set_defaults(handler=run)


def _median_ms(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e3


def run(args: argparse.Namespace) -> int:
    import numpy as np

    rng = random.Random(0)
    tokens = [rng.randrange(150_000) for _ in range(args.tokens)]
    array = np.asarray(tokens, dtype=np.int64)
    rows, runs = [], []
    for page_size in (int(p) for p in args.page_sizes.split(",")):
        ns = KeyNamespace("bench", "0", "bfloat16", "x", page_size)
        seed, data = ns.seed(), token_bytes(tokens)
        from_list = _median_ms(lambda ps=page_size, n=ns: page_keys(tokens, ps, n), args.repeats)
        from_array = _median_ms(lambda ps=page_size, n=ns: page_keys(array, ps, n), args.repeats)
        chain = _median_ms(lambda ps=page_size, s=seed, d=data: chain_keys(d, ps, s), args.repeats)
        pages = args.tokens // page_size
        runs.append({"page_size": page_size, "pages": pages, "tokens": args.tokens,
                     "ms_from_list": from_list, "ms_from_numpy": from_array,
                     "ms_chain_only": chain, "us_per_page": chain * 1e3 / max(pages, 1)})
        rows.append([page_size, pages, from_list, from_array, chain, chain * 1e3 / max(pages, 1)])
    print(format_table(["page_size", "pages", "ms(list)", "ms(numpy)", "ms(chain)", "us/page"], rows))
    if args.json:
        write_report(args.json, "keys", {"hash": "sha256", "runs": runs})
    return 0
