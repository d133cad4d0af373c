"""vLLM's CPU backend on a hybrid sliding-window model, with and without a KV connector: how
often a run decodes NaN logits (every request's first token right, every later one 0).

A connector that lacks ``SupportsHMA`` makes vLLM turn its hybrid KV-cache manager off: every
layer, sliding or full, then gets full-attention blocks in one KV cache group. kvtier's vLLM
suite saw such runs fail now and then, in kvtier's store and load runs alike; this probe runs
the suite's hybrid model (``tests/vllm_suite/test_hybrid_models.py``: a tiny random Llama,
sliding and full layers alternating, a 64-token window, two 300-token prompts, 6 tokens each)
``--runs`` times in fresh engine processes for each ``--configs`` entry: ``alone`` (vLLM, no
connector: its hybrid manager on), ``noop`` (the suite's connector that does nothing: the
manager off, nothing of kvtier's in the process) and ``kvtier`` (kvtier's connector, host tier
only, storing), and counts the runs whose output is vLLM alone's, NaN-decoded, or otherwise
different. Prints a table and writes JSON (with the machine's facts) to ``--json``. Main thread;
each run is a child process (the suite's ``scenario.py``).

    env -u PYTHONPATH TRITON_INTERPRET=1 .venv-vllm/bin/python benchmarks/vllm/hybrid_nan_probe.py \\
        --runs 10 --json /tmp/hybrid_nan.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SUITE = Path(__file__).resolve().parents[2] / "tests" / "vllm_suite"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="alone,noop,kvtier")
    p.add_argument("--runs", type=int, default=10, help="fresh engine processes per config")
    p.add_argument("--json", default="", help="write the counts and every run's verdict here")
    args = p.parse_args()
    sys.path.insert(0, str(SUITE))
    import test_hybrid_models as hybrid
    from vllm_helpers import run_scenario

    from kvtier.machine import format_table, machine_info

    work = Path(tempfile.mkdtemp(prefix="hybrid-nan-"))
    model = hybrid._model(work, ["sliding_attention", "full_attention"] * 2)
    reference = run_scenario(hybrid._spec(model, None, hybrid.PROMPTS), work / "reference")
    want = hybrid._tokens(reference["steps"][0])
    runs: dict[str, list[dict[str, Any]]] = {}
    for i in range(args.runs):               # configs interleaved: the machine's load is shared
        for config in args.configs.split(","):
            connector: Any = {"alone": None, "noop": "noop"}.get(
                config, {"host_pool_bytes": "64MiB"})
            started = time.perf_counter()
            run = run_scenario(hybrid._spec(model, connector, hybrid.PROMPTS),
                               work / f"{config}-{i}")
            got = hybrid._tokens(run["steps"][0])
            verdict = ("same" if got == want else "nan" if hybrid._nan_decoded(run, reference)
                       else "different")
            runs.setdefault(config, []).append(
                {"verdict": verdict, "seconds": round(time.perf_counter() - started, 1),
                 **({"tokens": got} if verdict == "different" else {})})
            print(f"run {i} {config}: {verdict}", flush=True)
    rows = [[config, len(r), sum(x["verdict"] == "same" for x in r),
             sum(x["verdict"] == "nan" for x in r), sum(x["verdict"] == "different" for x in r)]
            for config, r in runs.items()]
    print(format_table(["config", "runs", "vLLM alone's output", "NaN decode", "other"], rows))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"args": vars(args), "reference": want, "runs": runs, "machine": machine_info()},
            indent=1) + "\n")


if __name__ == "__main__":
    main()
