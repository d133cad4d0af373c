"""``vllm_serve.py``'s servers: one ``vllm serve`` process per config (``alone``, ``native``,
``kvtier``, ``direct``) in its own process group on a free port, its command line, waiting for ``/health``,
stopping the whole group, the counters read from ``/metrics``, the error lines of its log, and
``run_config`` (warm-up and every workload through kvtier's load generator against one server).
The main thread runs it; a watchdog timer thread stops a server past its deadline, and the load
generator adds a thread per request in flight.
"""

from __future__ import annotations

import argparse
import json
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

from vllm_serve_plan import log, warmup_requests

REPO = Path(__file__).resolve().parents[2]
CONFIGS = ("alone", "native", "kvtier", "direct")
#: Configs that run kvtier's connector (staged; direct: no staging pages).
KVTIER_CONFIGS = ("kvtier", "direct")
MODEL_NAME = "kvtier-bench"
#: vLLM counters read from ``/metrics`` before and after each workload (summed over labels).
COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
            "vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits",
            "vllm:num_preemptions")
#: vLLM's per-request phase histograms: time waiting to be scheduled, prefill time (first
#: scheduled to first token) and the server's own TTFT; their sums over counts split a TTFT.
PHASES = ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
          "vllm:time_to_first_token_seconds")


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
    elif config in KVTIER_CONFIGS:
        extra: dict[str, Any] = {"host_pool_bytes": f"{gib}GiB",
                                 "pinned_budget_bytes": f"{gib + 4}GiB"}
        extra.update({"direct": True} if config == "direct"
                     else {"staging_pages": plan["kvtier_staging_pages"]})
        cmd += ["--kv-transfer-config", json.dumps({
            "kv_connector": "KvtierConnector", "kv_connector_module_path":
            "kvtier.integrations.vllm", "kv_role": "kv_both", "kv_connector_extra_config": extra})]
    return cmd + shlex.split(args.vllm_args)


class Server:
    """One ``vllm serve`` process in its own process group, its output in a log file."""

    def __init__(self, cmd: list[str], port: int, log_path: Path,
                 profile_dir: Path | None = None) -> None:
        self.cmd, self.url, self.log_path = cmd, f"http://127.0.0.1:{port}", log_path
        self.profile_dir = profile_dir        # --profile-loop: the engine steps' profiles
        self.proc: subprocess.Popen[bytes] | None = None
        self.lock = threading.Lock()             # the watchdog's stop and the caller's

    def start(self) -> None:
        env = dict(os.environ)
        src = str(REPO / "src")                # this tree's kvtier, inside the server too
        first = [src]
        if self.profile_dir is not None:     # loop_profile/sitecustomize.py, in every process
            first.insert(0, str(Path(__file__).resolve().parent / "loop_profile"))
            env["KVTIER_LOOP_PROFILE"] = str(self.profile_dir)
        env["PYTHONPATH"] = os.pathsep.join([*first, *[p for p in env.get(
            "PYTHONPATH", "").split(os.pathsep) if p and p not in first]])
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
    """vLLM's ``COUNTERS``, kvtier's connector counters (``vllm:kvtier_*``), the native
    offloading's counters and histogram sums (``vllm:kv_offload*``) and the sums and counts of
    vLLM's per-request phase histograms (``PHASES``) of a Prometheus text page,
    each summed over its label sets, named without ``_total``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.split("{", 1)[0].split(" ", 1)[0], line.rsplit(" ", 1)[1]
        base = name.removesuffix("_total")
        wanted = base in COUNTERS or (name.endswith("_total") and base.startswith("vllm:kvtier_"))\
            or (base.startswith(("vllm:kv_offload",) + PHASES) and name.endswith(("_sum", "_count")))\
            or (base.startswith("vllm:kv_offload") and name.endswith("_total"))
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
    server = Server(server_command(args, config, port, plan), port, out / f"server_{config}.log",
                    out / f"loop_profile_{config}" if args.profile_loop else None)
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
