"""``kvtier bench store`` from two source trees, taking turns, to see whether a change moved it.

Each round runs the same ``kvtier bench store`` command once with ``PYTHONPATH=<tree>/src`` per
tree, alternating which goes first; the store's own read/raw and write/raw ratios (each already
measured beside the raw baseline in the same process) are what is compared, since on a shared
machine the absolute rates follow the load. Prints a table of the medians and writes JSON.

    git archive HEAD~5 src | tar -x -C /tmp/before
    python benchmarks/probes/compare_store_trees.py --before /tmp/before --after . --rounds 3 \
        --out benchmarks/results/store_trees -- --total 128MiB --page-bytes 64KiB --threads 2

Main thread; the runs are child processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvtier.machine import format_table, write_report

FIELDS = ("read_vs_raw", "write_vs_raw", "read_gbps", "write_gbps", "contains_ms_per_100k")


def one_run(tree: Path, bench_args: list[str], workdir: Path) -> dict[str, Any]:
    out = workdir / "run.json"
    env = {**os.environ, "PYTHONPATH": str(tree.resolve() / "src")}
    argv = [sys.executable, "-m", "kvtier", "bench", "store", "--url",
            f"file://{workdir.resolve()}/store", "--json", str(out), *bench_args]
    subprocess.run(argv, env=env, check=True, capture_output=True)
    return json.loads(out.read_text())["runs"][0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="Tree holding src/kvtier.")
    parser.add_argument("--after", type=Path, required=True, help="Tree holding src/kvtier.")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/store_trees")
    parser.add_argument("bench_args", nargs="*", help="Arguments for kvtier bench store.")
    args = parser.parse_args(argv)
    trees = {"before": args.before, "after": args.after}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory(prefix="kvtier-trees-") as tmp:
        for round_ in range(args.rounds):
            order = list(trees) if round_ % 2 == 0 else list(trees)[::-1]
            for name in order:
                runs[name].append(one_run(trees[name], args.bench_args, Path(tmp)))
    medians = {name: {f: statistics.median(r[f] for r in rs) for f in FIELDS}
               for name, rs in runs.items()}
    print(format_table(["tree", *FIELDS], [[n, *m.values()] for n, m in medians.items()]))
    write_report(f"{args.out}.json", "compare_store_trees", {
        "trees": {n: str(t) for n, t in trees.items()}, "bench_args": args.bench_args,
        "medians": medians, "runs": runs, "load_avg": os.getloadavg()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
