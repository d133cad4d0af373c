"""Serving through ``vllm serve`` (the OpenAI server): vLLM alone, vLLM's native CPU offloading
and kvtier's connector, one after another on the same GPU, under the same workloads.

Each config is a fresh server process (its own process group, a free port), killed before the
next starts:

- ``alone``: vLLM with prefix caching, nothing below the GPU;
- ``native``: vLLM's own CPU offloading (``--kv-offloading-size GiB --kv-offloading-backend
  native``);
- ``kvtier``: kvtier's connector, host tier only (``host_pool_bytes`` = the same GiB,
  ``pinned_budget_bytes`` 4 GiB more).

Every server gets the same model (a directory holding a config.json of one of kvtier's presets
and kvtier's tokenizer, random weights: ``--load-format dummy``), dtype, block size, prefix
caching, ``--enable-prompt-tokens-details`` (so usage reports ``cached_tokens``) and the same
GPU memory for KV, chosen from the workloads so that their working set does not fit on the GPU
(the point of a tier below it)::

    staging_tokens = concurrency x the longest prompt (kvtier's staging pages, --staging-pages)
    gpu_kv_tokens  = max(--gpu-kv-fraction x the largest working set,
                         --inflight-headroom x concurrency x the longest request
                         + staging_tokens)

The working set is every distinct full block of the workload's prompts plus its outputs
(``working_set_tokens``). The in-flight term keeps the requests in flight on the GPU without
preemption (a smaller cache would measure preemption, not offloading). kvtier's staging pages
are GPU memory beside vLLM's KV cache (a hit staged on its way from the host tier, a prompt
being stored, kvtier's device tier): they come out of kvtier's ``--kv-cache-memory-bytes``, so
all three servers hold the same GPU bytes of KV (``--kvtier-extra-gpu``: on top instead). They
are sized so that each request in flight can stage a whole prompt: a save that finds no free
staging page is refused (counted ``vllm:kvtier_saves_refused_no_staging``). The host size,
``--host-gib``, defaults to 1.5 x the largest working set, so both tiers below the GPU can keep
a whole workload. The numbers and which term won are in the JSON (``plan``).

Workloads (token-id prompts, seeded, the same for every config; kvtier's load generator,
``kvtier.bench.serve_load``, at ``--concurrency`` requests in flight):

- ``shared-prefix``: ``--groups`` groups of a ``--prefix-len``-token prefix, each request its
  group's prefix and ``--suffix-len`` tokens of its own, ``--rounds`` rounds in group order, so
  each prefix comes back after all the others went through the GPU;
- ``multi-turn``: ``--conversations`` chats of ``--turns`` turns
  (``serve_workloads.conversations``): every turn re-sends the whole history (a shared
  ``--system-len`` system prompt, earlier ``--user-len`` user messages and ``--output-len``
  replies) plus a new user message; all first turns, then all second turns, and so on (a turn is
  sent ``--conversations`` requests after the same chat's previous turn).

A warm-up of ``--concurrency`` short unrelated requests runs on each server first. Reported per
config and workload: TTFT p50/p99, ITL p50 (gaps between streamed chunks), requests/s, output
tokens/s, the share of prompt tokens the server reports cached, vLLM's prefix-cache and
preemption counters, kvtier's connector counters and the native offloading's from ``/metrics``
over the workload, and the ratios kvtier/native and kvtier/alone. A server that does not come
up is recorded with its log's tail and the lines naming an error, and the run goes on;
``--budget-s`` bounds the whole run, ``--config-timeout-s`` each server (past it the server is
killed, its requests in flight fail).

    PYTHONPATH=src python3 benchmarks/vllm/vllm_serve.py --out OUT         # on the GPU machine

writes ``vllm_serve_<gpu>.json`` (args, memory plan, results, ratios, machine), the table as
``vllm_serve_<gpu>.txt`` and every server's log under ``--out``. Main thread; the load
generator adds a thread per request in flight.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from vllm_gpu import build_model_dir
from vllm_gpu_case import TOKEN_HIGH

REPO = Path(__file__).resolve().parents[2]
CONFIGS = ("alone", "native", "kvtier")
WORKLOADS = ("shared-prefix", "multi-turn")
MODEL_NAME = "kvtier-bench"
#: vLLM counters read from ``/metrics`` before and after each workload (summed over labels).
COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
            "vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits",
            "vllm:num_preemptions")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


def log(msg: str) -> None:
    print(f"[serve] {msg}", flush=True)


# ================================================================================================
# workloads and the memory plan
# ================================================================================================
def build_workloads(args: argparse.Namespace) -> dict[str, list[Any]]:
    from kvtier.bench.serve_workloads import conversations, shared_prefix

    out: dict[str, list[Any]] = {}
    if "shared-prefix" in args.workloads:
        out["shared-prefix"] = shared_prefix(
            args.groups * args.rounds, args.groups, args.prefix_len, args.suffix_len,
            args.output_len, TOKEN_HIGH, seed=args.seed)
    if "multi-turn" in args.workloads:
        out["multi-turn"] = conversations(
            args.conversations, args.turns, args.system_len, args.user_len, args.output_len,
            args.output_len, TOKEN_HIGH, seed=args.seed)
    return out


def warmup_requests(args: argparse.Namespace) -> list[Any]:
    from kvtier.bench.serve_workloads import random_prompts

    return random_prompts(args.concurrency, 4 * args.block_size, 8, TOKEN_HIGH,
                          seed=args.seed + 7919)


def working_set_tokens(requests: list[Any], block: int) -> int:
    """Tokens the workload would keep cached: its prompts' distinct full blocks (a block is
    known by its whole prefix, as prefix caches key it) plus every output token."""
    seen: set[int] = set()
    for r in requests:
        key = 0
        for start in range(0, len(r.prompt) - block + 1, block):
            key = hash((key, r.prompt[start:start + block]))
            seen.add(key)
    return len(seen) * block + sum(r.max_tokens for r in requests)


def kv_bytes_per_token(preset: str, dtype: str) -> int:
    from kvtier.engine.presets import PRESETS

    c = PRESETS[preset].config or {}
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    return int(c["num_hidden_layers"] * heads * head_dim * 2 * DTYPE_BYTES[dtype])


def plan_memory(args: argparse.Namespace, workloads: dict[str, list[Any]]) -> dict[str, Any]:
    """The GPU KV cache, kvtier's staging pages and the host size (see the module's doc)."""
    per_token = kv_bytes_per_token(args.preset, args.dtype)
    sets = {name: working_set_tokens(reqs, args.block_size) for name, reqs in workloads.items()}
    longest = max(len(r.prompt) + r.max_tokens for reqs in workloads.values() for r in reqs)
    longest_prompt = max(len(r.prompt) for reqs in workloads.values() for r in reqs)
    staging = args.staging_pages or args.concurrency * -(-longest_prompt // args.block_size)
    staging_tokens = 0 if args.kvtier_extra_gpu else staging * args.block_size
    by_fraction = math.ceil(args.gpu_kv_fraction * max(sets.values()))
    inflight = math.ceil(args.inflight_headroom * args.concurrency * longest) + staging_tokens
    tokens = max(by_fraction, inflight)
    tokens = -(-tokens // args.block_size) * args.block_size
    reason = "fraction of the working set" if by_fraction >= inflight else "requests in flight"
    gpu_bytes = tokens * per_token
    if args.gpu_kv_bytes:
        gpu_bytes, reason = int(args.gpu_kv_bytes), "--gpu-kv-bytes"
    staging_bytes = staging * args.block_size * per_token
    host_gib = args.host_gib or round(math.ceil(1.5 * max(sets.values()) * per_token / 2**30 * 4)
                                      / 4, 2)
    plan = {"kv_bytes_per_token": per_token, "working_set_tokens": sets,
            "longest_request_tokens": longest, "gpu_kv_tokens": gpu_bytes // per_token,
            "gpu_kv_bytes": gpu_bytes, "gpu_kv_chosen_by": reason, "host_gib": host_gib,
            "gpu_share_of_working_set": {n: round(gpu_bytes / per_token / s, 3)
                                         for n, s in sets.items()},
            "max_model_len": -(-(longest + 64) // 256) * 256,
            # kvtier's staging pages (one page per vLLM block) sit on the GPU beside vLLM's KV
            # cache: they hold a hit between the host tier and vLLM's blocks and a prompt being
            # stored, and serve as kvtier's device tier. Unless --kvtier-extra-gpu they come out
            # of kvtier's share, so every server has the same GPU memory for KV.
            "kvtier_staging_pages": staging, "kvtier_staging_bytes": staging_bytes,
            "kvtier_vllm_kv_bytes": gpu_bytes - (0 if args.kvtier_extra_gpu else staging_bytes)}
    if plan["kvtier_vllm_kv_bytes"] < args.concurrency * longest * per_token:
        log("warning: kvtier's vLLM KV cache cannot hold the requests in flight (preemption)")
    if gpu_bytes // per_token >= max(sets.values()):
        log("warning: the GPU KV cache holds a whole working set; offloading cannot help")
    return plan


# ================================================================================================
# one server
# ================================================================================================
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(args: argparse.Namespace, config: str, port: int,
                   plan: dict[str, Any]) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model_dir,
           "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--load-format", "dummy", "--dtype", args.dtype, "--seed", "0",
           "--max-model-len", str(plan["max_model_len"]), "--block-size", str(args.block_size),
           "--enable-prefix-caching", "--kv-cache-memory-bytes",
           str(plan["kvtier_vllm_kv_bytes" if config == "kvtier" else "gpu_kv_bytes"]),
           "--max-num-seqs", str(max(8, args.concurrency)), "--enable-prompt-tokens-details",
           "--disable-uvicorn-access-log"]
    if args.eager:
        cmd.append("--enforce-eager")
    gib = plan["host_gib"]
    if config == "native":
        cmd += ["--kv-offloading-size", str(gib), "--kv-offloading-backend", "native"]
    elif config == "kvtier":
        extra: dict[str, Any] = {"host_pool_bytes": f"{gib}GiB",
                                 "pinned_budget_bytes": f"{gib + 4}GiB",
                                 "staging_pages": plan["kvtier_staging_pages"]}
        cmd += ["--kv-transfer-config", json.dumps({
            "kv_connector": "KvtierConnector", "kv_connector_module_path":
            "kvtier.integrations.vllm", "kv_role": "kv_both", "kv_connector_extra_config": extra})]
    return cmd + shlex.split(args.vllm_args)


class Server:
    """One ``vllm serve`` process in its own process group, its output in a log file."""

    def __init__(self, cmd: list[str], port: int, log_path: Path) -> None:
        self.cmd, self.url, self.log_path = cmd, f"http://127.0.0.1:{port}", log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.lock = threading.Lock()             # the watchdog's stop and the caller's

    def start(self) -> None:
        env = dict(os.environ)
        src = str(REPO / "src")                # this tree's kvtier, inside the server too
        env["PYTHONPATH"] = os.pathsep.join([src, *[p for p in env.get("PYTHONPATH", "").split(
            os.pathsep) if p and p != src]])
        with open(self.log_path, "wb") as out:
            out.write((shlex.join(self.cmd) + "\n").encode())
            out.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)

    def wait_ready(self, deadline: float) -> str | None:
        """None once ``/health`` answers 200; else why not (exited, out of time)."""
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"server exited with {self.proc.returncode} before it was ready"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return None
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(1.0)
        return "server not ready in time"

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL after 20 s, then wait until the group is gone (the
        GPU memory is free before the next server starts)."""
        with self.lock:
            if self.proc is not None:
                self._stop(self.proc)
                self.proc = None

    @staticmethod
    def _stop(proc: subprocess.Popen[bytes]) -> None:
        pgid = proc.pid
        for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 15.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            end = time.monotonic() + wait
            while time.monotonic() < end:
                proc.poll()
                try:
                    os.killpg(pgid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.2)
            else:
                continue
            break
        proc.poll()

    def tail(self, lines: int = 40) -> list[str]:
        return self.lines()[-lines:]

    def lines(self) -> list[str]:
        try:
            return self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []


def counters(url: str) -> dict[str, float]:
    """``parse_counters`` of the server's ``/metrics`` ({} if it does not answer)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            return parse_counters(r.read().decode(errors="replace"))
    except (OSError, urllib.error.URLError):
        return {}


def parse_counters(text: str) -> dict[str, float]:
    """vLLM's ``COUNTERS``, kvtier's connector counters (``vllm:kvtier_*``) and the native
    offloading's counters and histogram sums (``vllm:kv_offload*``) of a Prometheus text page,
    each summed over its label sets, named without ``_total``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.split("{", 1)[0].split(" ", 1)[0], line.rsplit(" ", 1)[1]
        base = name.removesuffix("_total")
        wanted = base in COUNTERS or (name.endswith("_total") and base.startswith("vllm:kvtier_"))\
            or (base.startswith("vllm:kv_offload") and name.endswith(("_total", "_sum", "_count")))
        if wanted:
            try:
                out[base] = out.get(base, 0.0) + float(value)
            except ValueError:
                pass
    return out


def log_errors(lines: list[str], most: int = 8) -> list[str]:
    """The distinct lines of a server log that name an error (the root cause is among them)."""
    seen: dict[str, None] = {}
    for line in lines:
        if "Error" in line or "error" in line:
            seen.setdefault(line.split("] ", 1)[-1].strip()[:400], None)
    return list(seen)[:most]


def run_config(args: argparse.Namespace, config: str, workloads: dict[str, list[Any]],
               plan: dict[str, Any], deadline: float, out: Path) -> dict[str, Any]:
    from kvtier.bench.serve_load import run_load, summarize

    port = free_port()
    server = Server(server_command(args, config, port, plan), port, out / f"server_{config}.log")
    res: dict[str, Any] = {"config": config, "ok": False, "port": port, "workloads": {}}
    # Past the deadline the server is killed: requests in flight fail and the run goes on.
    watchdog = threading.Timer(max(1.0, deadline - time.monotonic()), server.stop)
    started = time.monotonic()
    try:
        server.start()
        watchdog.start()
        why = server.wait_ready(deadline)
        res["start_s"] = round(time.monotonic() - started, 1)
        if why:
            res["error"], res["log_tail"] = why, server.tail()
            res["log_errors"] = log_errors(server.lines())
            log(f"{config}: {why}; errors in its log:\n    " + "\n    ".join(res["log_errors"]))
            return res
        log(f"{config}: ready in {res['start_s']} s")
        warm, warm_s = run_load(server.url, MODEL_NAME, warmup_requests(args),
                                concurrency=args.concurrency)
        res["warmup"] = summarize(warm, warm_s)
        for name, requests in workloads.items():
            if time.monotonic() > deadline - 5:
                res["workloads"][name] = {"error": "no time left"}
                continue
            before = counters(server.url)
            results, wall = run_load(server.url, MODEL_NAME, requests,
                                     concurrency=args.concurrency, seed=args.seed)
            after = counters(server.url)
            summary = summarize(results, wall)
            summary.pop("cached_share")             # kvtier's own server's per-tier usage only
            summary["vllm_counters"] = {k: after[k] - before.get(k, 0.0) for k in after}
            res["workloads"][name] = summary
            log(f"{config} / {name}: {len(requests)} requests in {wall:.1f} s, TTFT p50 "
                f"{summary['ttft_ms_p50'] or 0:.1f} ms, cached {summary['cached_tokens_share']}, "
                f"failed {summary['failed']}")
        res["ok"] = all(w.get("failed") == 0 for w in res["workloads"].values())
        if not res["ok"]:
            res["log_tail"], res["log_errors"] = server.tail(), log_errors(server.lines())
    except Exception as exc:       # recorded; the next config still runs
        res["error"], res["log_tail"] = f"{type(exc).__name__}: {exc}", server.tail()
        res["log_errors"] = log_errors(server.lines())
        log(f"{config}: {res['error']}")
    finally:
        watchdog.cancel()
        server.stop()
        res["wall_s"] = round(time.monotonic() - started, 1)
    return res


# ================================================================================================
# report
# ================================================================================================
METRICS = (("ttft_ms_p50", "TTFT p50"), ("ttft_ms_p99", "TTFT p99"), ("itl_ms_p50", "ITL p50"),
           ("requests_per_s", "req/s"), ("output_tokens_per_s", "out tok/s"),
           ("cached_tokens_share", "cached"))


def _ratio(a: Any, b: Any) -> float | None:
    ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and b
    return round(a / b, 3) if ok else None


def summarize_runs(results: list[dict[str, Any]],
                   workloads: list[str]) -> tuple[dict[str, Any], str]:
    from kvtier.machine import format_table

    by = {r["config"]: r.get("workloads", {}) for r in results}
    summary: dict[str, Any] = {}
    rows = []
    for name in workloads:
        cells = {c: by.get(c, {}).get(name, {}) for c in CONFIGS}
        ratios = {f"kvtier/{base}": {key: _ratio(cells["kvtier"].get(key), cells[base].get(key))
                                     for key, _ in METRICS[:-1]} for base in ("native", "alone")}
        summary[name] = {"ratios": ratios}
        for c in CONFIGS:
            w = cells[c]
            hits = w.get("vllm_counters", {})
            rows.append([name, c, *[w.get(key) for key, _ in METRICS],
                         int(hits.get("vllm:num_preemptions", 0)) if hits else None,
                         w.get("failed", w.get("error", "not run"))])
        for base, r in ratios.items():
            rows.append([name, base, *[r.get(key) for key, _ in METRICS[:-1]], "", "", ""])
    text = format_table(["workload", "config", *[label for _, label in METRICS], "preempt",
                         "failed"], rows)
    text += "\n(times in ms; cached: share of prompt tokens the server reports cached; " \
            "kvtier/X rows: ratios, lower is better for times, higher for rates)"
    return summary, text


def gpu_tag() -> str:
    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "cpu"
    for tag in ("h200", "h100", "a100", "l40s", "b200"):
        if tag in name.lower():
            return tag
    return name.split("\n")[0].strip().lower().replace(" ", "_") or "cpu"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--preset", default="llama3-8b-shape")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--model-dir", default="", help="where the model directory is built "
                   "(default: under --out)")
    p.add_argument("--block-size", type=int, default=16, help="vLLM's (32 on its CPU backend)")
    p.add_argument("--eager", action="store_true", help="--enforce-eager (no CUDA graphs)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--groups", type=int, default=24)
    p.add_argument("--prefix-len", type=int, default=4096)
    p.add_argument("--suffix-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--user-len", type=int, default=384)
    p.add_argument("--output-len", type=int, default=64,
                   help="tokens generated per request (and each earlier reply's length)")
    p.add_argument("--gpu-kv-fraction", type=float, default=0.25,
                   help="GPU KV cache as a share of the largest working set (at least)")
    p.add_argument("--inflight-headroom", type=float, default=1.25,
                   help="GPU KV cache at least this x concurrency x the longest request")
    p.add_argument("--gpu-kv-bytes", type=int, default=0, help="override the GPU KV cache")
    p.add_argument("--host-gib", type=float, default=0.0,
                   help="native offloading size and kvtier's host tier (0: 1.5 x working set)")
    p.add_argument("--staging-pages", type=int, default=0,
                   help="kvtier's staging pages (0: concurrency x the longest prompt's blocks)")
    p.add_argument("--kvtier-extra-gpu", action="store_true",
                   help="kvtier's staging pages on top of the GPU KV cache, not out of it")
    p.add_argument("--vllm-args", default="", help="more flags for every server")
    p.add_argument("--budget-s", type=float, default=510.0, help="the whole run")
    p.add_argument("--config-timeout-s", type=float, default=300.0,
                   help="one server: start, warm-up and workloads")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    args.configs = [c for c in args.configs.split(",") if c]
    args.workloads = [w for w in args.workloads.split(",") if w]
    bad = [c for c in args.configs if c not in CONFIGS] + \
        [w for w in args.workloads if w not in WORKLOADS]
    if bad:
        p.error(f"unknown config or workload: {bad}")
    # A SIGTERM (an outer timeout) unwinds through ``finally``: the server is killed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.model_dir = args.model_dir or str(out / "model")
    build_model_dir(args.preset, Path(args.model_dir))
    workloads = build_workloads(args)
    plan = plan_memory(args, workloads)
    log("memory plan: " + json.dumps(plan))
    tag = gpu_tag()
    json_path, txt_path = out / f"vllm_serve_{tag}.json", out / f"vllm_serve_{tag}.txt"
    deadline = time.monotonic() + args.budget_s
    results: list[dict[str, Any]] = []
    for config in args.configs:
        left = deadline - time.monotonic()
        if left < 30:
            results.append({"config": config, "ok": False, "error": "no time left"})
            continue
        log(f"config {config} ({left:.0f} s left)")
        results.append(run_config(args, config, workloads, plan,
                                  time.monotonic() + min(left - 5, args.config_timeout_s), out))
        json_path.write_text(json.dumps({"benchmark": "vllm_serve", "partial": True,
                                         "args": vars(args), "plan": plan, "configs": results},
                                        indent=2, default=str))
    summary, text = summarize_runs(results, list(workloads))
    header = (f"vllm serve, {args.preset} {args.dtype}, concurrency {args.concurrency}, "
              f"GPU KV {plan['gpu_kv_tokens']} tokens ({plan['gpu_kv_chosen_by']}), host "
              f"{plan['host_gib']} GiB, working sets {plan['working_set_tokens']} tokens, "
              f"kvtier's staging pages {plan['kvtier_staging_bytes'] / 2**20:.0f} MiB "
              f"{'on top' if args.kvtier_extra_gpu else 'out of its GPU KV cache'}, "
              f"{'eager' if args.eager else 'CUDA graphs'}")
    print("\n" + header + "\n" + text)
    failed = [f"{r['config']}: {r.get('error')}" for r in results if not r.get("ok")]
    if failed:
        print("failed: " + "; ".join(failed))
    txt_path.write_text(header + "\n" + text + "\n" + ("failed: " + "; ".join(failed) + "\n"
                                                       if failed else ""))
    from importlib import metadata

    from kvtier.machine import write_report

    versions = {}
    try:
        versions["vllm"] = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        pass
    write_report(json_path, "vllm_serve", {"args": vars(args), "versions": versions,
                                           "plan": plan, "summary": summary,
                                           "configs": results})
    print(f"wrote {json_path} and {txt_path}")


if __name__ == "__main__":
    main()
