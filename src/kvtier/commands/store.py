"""``kvtier store ls|stats|verify|gc --url URL``: inspect and maintain a page store.

``stats`` works for any store URL; ``ls``, ``verify`` and ``gc`` look inside ``file://`` stores.
``verify`` reads and checks every live record (with a progress bar) and exits 1 when any fails
(exit 1 means damage found, nothing else: a store that cannot be opened, or a bad argument, is
``kvtier: error: ...`` and exit 2, as for every command);
``gc`` evicts the oldest segments until the store is at most ``--target`` bytes. A file store's
page size comes from its manifest; other stores need ``--page-bytes``. Opening never creates a
store. Runs on the main thread.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any
from urllib.parse import urlsplit

from kvtier.errors import ConfigError, KvtierError, StoreUnavailable
from kvtier.units import parse_size


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("store", help="Inspect and maintain a page store (ls, stats, "
                                   "verify, gc).", description=__doc__.splitlines()[0])
    inner = parser.add_subparsers(dest="store_command", metavar="ACTION", required=True)
    for name, help_text, handler in (
        ("ls", "List pages (key, segment, slot).", run_ls),
        ("stats", "Print page counts, counters and disk usage.", run_stats),
        ("verify", "Read and check every record; exit 1 on any failure.", run_verify),
        ("gc", "Evict oldest segments down to --target bytes.", run_gc),
    ):
        sub = inner.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--url", required=True, help="Store URL, e.g. file:///var/cache/kvtier.")
        sub.add_argument("--page-bytes", type=_size, help="Page size (file stores: from the "
                         "manifest).")
        sub.set_defaults(handler=handler)
        if name == "ls":
            sub.add_argument("--limit", type=int, default=0, help="Show at most N pages (0: all).")
        if name in ("ls", "stats", "verify"):
            sub.add_argument("--json", action="store_true", help="Print JSON.")
        if name == "verify":
            sub.add_argument("--no-progress", action="store_true", help="No progress bar.")
        if name == "gc":
            sub.add_argument("--target", type=_size, required=True,
                             help="Bytes of segments to keep, e.g. 10GiB (0: evict all).")


def _size(text: str) -> int:
    value = parse_size(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r}")
    return value


def _open(args: argparse.Namespace, need_file: bool = False) -> Any:
    from kvtier.store import open_store

    parts = urlsplit(args.url)
    page_bytes = args.page_bytes
    if parts.scheme == "file":
        from kvtier.store.file.options import file_url_path
        from kvtier.store.file.segment import MANIFEST, read_manifest

        root = file_url_path(args.url)
        if not (root / MANIFEST).exists():
            raise StoreUnavailable(f"no kvtier file store at {root} (no {MANIFEST} there)")
        page_bytes = page_bytes or read_manifest(root).page_bytes
    elif need_file:
        raise ConfigError("--url", args.url, f"a file:// store for 'kvtier store {args.store_command}'")
    if not page_bytes:
        raise ConfigError("--page-bytes", None, "the page size of the store (required for "
                          f"{parts.scheme}:// stores)")
    try:
        return open_store(args.url, page_bytes=page_bytes)
    except KvtierError:
        raise
    except OSError as exc:  # anything the store did not name itself: still an open error
        raise StoreUnavailable(f"cannot open {args.url}: {exc}") from None


def run_ls(args: argparse.Namespace) -> int:
    from kvtier.store.file.tools import iter_pages

    with _open(args, need_file=True) as store:
        rows = []
        for n, (key, seg, slot) in enumerate(iter_pages(store)):
            if args.limit and n >= args.limit:
                break
            rows.append({"key": key.hex(), "segment": seg, "slot": slot})
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for row in rows:
            print(f"{row['key']}  segment {row['segment']:>8}  slot {row['slot']:>6}")
    return 0


def run_stats(args: argparse.Namespace) -> int:
    with _open(args) as store:
        data: dict[str, Any] = {"page_bytes": store.page_bytes, **store.stats().as_dict()}
        if hasattr(store, "disk_usage"):
            data.update(store.disk_usage())
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        for name, value in data.items():
            print(f"{name:20s} {value}")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvtier.store.file.tools import VERDICTS, verify_all

    with _open(args, need_file=True) as store:
        total = store.stats().pages
        with tqdm(total=total, unit="page", disable=args.no_progress or args.json,
                  file=sys.stderr) as bar:
            counts = verify_all(store, bar.update)
    result = {v: counts.get(v, 0) for v in VERDICTS}
    failed = sum(n for v, n in result.items() if v not in ("ok", "gone"))
    if args.json:
        print(json.dumps({**result, "failed": failed}, indent=2))
    else:
        print("  ".join(f"{v}={n}" for v, n in result.items()))
        print(f"verify: {'FAILED' if failed else 'ok'}: {failed} of {sum(result.values())} "
              "records failed their checks")
    return 1 if failed else 0


def run_gc(args: argparse.Namespace) -> int:
    with _open(args, need_file=True) as store:
        before = store.disk_usage()["segment_bytes"]
        dropped = store.evictor.gc(args.target)
        after = store.disk_usage()["segment_bytes"]
        pages = store.stats().pages
    print(f"gc: segment bytes {before} -> {after} (target {args.target}); "
          f"{dropped} pages evicted, {pages} remain")
    return 0 if after <= args.target else 1
