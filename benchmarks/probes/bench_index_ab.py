"""The index benchmark on two versions of kvtier side by side: a git revision and the work tree.

Extracts ``src/`` of ``--base`` (a git revision) into a temporary folder, then runs
``benchmarks/index/bench_index.py`` alternately on it and on this tree's ``src/`` (``--rounds`` times
each, base first), each run in its own process, and prints one table of every operation's
CPU-time p50 per version (median over the rounds) with the ratio new / base. CPU time is the
operation's own cost; on a shared machine the wall time adds whatever preempted it, and even
the CPU time drifts with the load (caches, frequency). So every operation is also timed against
a control measured in the same run: the key-table match with keys given, a dict probe loop that
no kvtier change touches. ``vs_control`` is the ratio new / base of op / control, each the
median over the rounds; 1.0 means the operation did not move relative to the machine.

Run: ``python benchmarks/probes/bench_index_ab.py --base REV [--pages 262144] [--repeats 100]
[--rounds 2] [--json out.json]``; ``--summarize out.json`` prints the table of saved runs
again. Main thread.
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

ROOT = Path(__file__).resolve().parents[2]


def extract(rev: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def one_run(src: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "index" / "bench_index.py"), "--pages",
                    str(args.pages), "--repeats", str(args.repeats), "--json", str(out)],
                   env=env, check=True, capture_output=True)
    return json.loads(out.read_text(encoding="utf-8"))


CONTROL = ("tree", "key table match (keys given)")


def _relative(report: dict[str, Any], i: int) -> float:
    control = next(r for r in report["runs"] if (r["case"], r["op"]) == CONTROL)
    return float(report["runs"][i]["cpu_p50_ms"] / control["cpu_p50_ms"])


def summarize(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for i, first in enumerate(runs["base"][0]["runs"]):
        row: dict[str, Any] = {"case": first["case"], "op": first["op"]}
        for version in ("base", "new"):
            row[f"{version}_cpu_p50_ms"] = statistics.median(r["runs"][i]["cpu_p50_ms"]
                                                             for r in runs[version])
            row[f"{version}_cpu_p50_ms_runs"] = [r["runs"][i]["cpu_p50_ms"] for r in runs[version]]
        row["ratio"] = row["new_cpu_p50_ms"] / row["base_cpu_p50_ms"]
        row["vs_control"] = (statistics.median(_relative(r, i) for r in runs["new"])
                             / statistics.median(_relative(r, i) for r in runs["base"]))
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    headers = ["case", "op", "base_cpu_p50_ms", "new_cpu_p50_ms", "ratio", "vs_control"]
    return format_table(headers, [[row[h] for h in headers] for row in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="Git revision to compare against (required unless "
                        "--summarize).")
    parser.add_argument("--pages", type=int, default=1 << 18, help="Pages to index.")
    parser.add_argument("--repeats", type=int, default=100, help="Timed repeats per operation.")
    parser.add_argument("--rounds", type=int, default=2, help="Runs per version, alternating.")
    parser.add_argument("--json", metavar="OUT", help="Write results as JSON here.")
    parser.add_argument("--summarize", metavar="JSON", help="Only print the table of runs a "
                        "previous --json saved.")
    args = parser.parse_args()
    if args.summarize:
        saved = json.loads(Path(args.summarize).read_text(encoding="utf-8"))
        print(table(summarize(saved["runs"])))
        return
    if not args.base:
        parser.error("--base is required (a git revision to compare against)")
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"base": extract(args.base, Path(tmp)), "new": ROOT / "src"}
        for round_ in range(args.rounds):
            for version in ("base", "new"):
                out = Path(tmp) / f"{version}{round_}.json"
                runs[version].append(one_run(sources[version], args, out))
    rows = summarize(runs)
    print(table(rows))
    if args.json:
        write_report(args.json, "index_ab", {"base": args.base, "pages": args.pages,
                                             "repeats": args.repeats, "rounds": args.rounds,
                                             "rows": rows, "runs": runs})


if __name__ == "__main__":
    main()
