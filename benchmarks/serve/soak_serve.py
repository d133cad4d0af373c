"""A soak of the default ``kvtier serve`` with clients that leave: memory and open files over time.

Starts the server as ``make run`` does (tiny-llama on the CPU, disk tier on, a free loopback
port), then, for ``--duration-s``, ``--clients`` threads each loop over four kinds of request:
a completion of a prompt that shares a prefix with others (hits), a stream read to its end, a
stream closed after its first chunks (a mid-stream disconnect), and a request whose body stops
half way before the socket closes (a disconnect before the body). Prompts share a prefix and
end in a random tail, or (``--distinct N``) in one of N fixed tails, so that the cache's
contents stop growing and what memory does is the server's own. Every ``--sample-s`` it reads
the server's resident memory (``VmRSS``) and open descriptors (``/proc/PID/fd``). At the end it
fits a line through the samples after the warm-up (``--warmup``, a share of the run) and reports
the slopes (MiB and descriptors per minute), the requests by outcome, the server's 5xx answers
and any traceback in its log, then stops it with SIGTERM and records the exit code.

    PYTHONPATH=src python benchmarks/serve/soak_serve.py --duration-s 1800 --json out.json

Prints a table; ``--json`` writes it with machine info. Loopback only; every loop is bounded by
the duration. Main thread plus the client threads.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from kvtier.machine import format_table, write_report

PREFIX = " ".join(f"shared{i % 89}" for i in range(160))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def sample(pid: int) -> tuple[float, int]:
    """Resident memory (MiB) and open descriptors of ``pid``."""
    rss_kib = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``(t, y)`` points, per minute."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return 0.0 if var == 0 else 60.0 * sum((t - mt) * (y - my) for t, y in points) / var


class Clients:
    """The request loop of every client thread, with counts by outcome."""

    def __init__(self, url: str, port: int, deadline: float, seed: int, distinct: int = 0) -> None:
        self.url, self.port, self.deadline = url, port, deadline
        fixed = random.Random(seed)
        self.tails = [" ".join(f"t{fixed.randrange(1000)}" for _ in range(fixed.randrange(4, 40)))
                      for _ in range(distinct)]
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.seed = seed

    def count(self, outcome: str) -> None:
        with self.lock:
            self.counts[outcome] += 1

    def run(self, index: int) -> None:
        rng = random.Random(self.seed + index)
        with httpx.Client(timeout=60) as http:
            while time.monotonic() < self.deadline:
                kind = rng.choice(("hit", "stream", "leave_stream", "leave_body"))
                try:
                    getattr(self, kind)(http, rng)
                except httpx.HTTPError as exc:
                    self.count(f"{kind}:client_error:{type(exc).__name__}")

    def body(self, rng: random.Random, stream: bool) -> dict[str, Any]:
        if self.tails:                  # a fixed set of prompts: the cache stops growing
            tail = rng.choice(self.tails)
        else:
            tail = " ".join(f"t{rng.randrange(1000)}" for _ in range(rng.randrange(4, 40)))
        return {"model": "tiny-llama", "prompt": f"{PREFIX} {tail}", "temperature": 0,
                "max_tokens": rng.randrange(4, 24), "stream": stream}

    def hit(self, http: httpx.Client, rng: random.Random) -> None:
        answer = http.post(self.url + "/v1/completions", json=self.body(rng, False))
        self.count(f"hit:{answer.status_code}")

    def stream(self, http: httpx.Client, rng: random.Random) -> None:
        with http.stream("POST", self.url + "/v1/completions",
                         json=self.body(rng, True)) as answer:
            for _ in answer.iter_lines():
                pass
            self.count(f"stream:{answer.status_code}")

    def leave_stream(self, http: httpx.Client, rng: random.Random) -> None:
        with httpx.Client(timeout=60) as own, own.stream(
                "POST", self.url + "/v1/completions", json=self.body(rng, True)) as answer:
            for n, _ in enumerate(answer.iter_lines()):
                if n >= 1:
                    break
            self.count(f"leave_stream:{answer.status_code}")

    def leave_body(self, http: httpx.Client, rng: random.Random) -> None:
        payload = json.dumps(self.body(rng, False)).encode()
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\n"
                         + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                         + payload[: len(payload) // 2])
        self.count("leave_body:sent")


def run(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-soak-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["KVTIER_SERVER__PORT"] = str(port)
    log_path = scratch / "server.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "kvtier", "serve", "--disk",
                                 f"file://{scratch}/disk"], env=env, stdout=log_file,
                                stderr=subprocess.STDOUT)
    started = time.monotonic()
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() - started > 300:
            raise RuntimeError(f"the server did not start (log: {log_path})")
        time.sleep(0.5)
    t0 = time.monotonic()
    clients = Clients(url, port, t0 + args.duration_s, args.seed, args.distinct)
    threads = [threading.Thread(target=clients.run, args=(i,), daemon=True)
               for i in range(args.clients)]
    for thread in threads:
        thread.start()
    samples: list[tuple[float, float, int]] = []
    while time.monotonic() < t0 + args.duration_s:
        rss, fds = sample(proc.pid)
        samples.append((time.monotonic() - t0, rss, fds))
        time.sleep(args.sample_s)
    for thread in threads:
        thread.join(120)
    rss, fds = sample(proc.pid)
    samples.append((time.monotonic() - t0, rss, fds))
    metrics = httpx.get(url + "/metrics", timeout=10).text
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(120)
    text = log_path.read_text(errors="replace")
    steady = [s for s in samples if s[0] >= args.warmup * args.duration_s]
    server_5xx = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                     if line.startswith("kvtier_http_server_errors_total{"))
    return {"duration_s": args.duration_s, "clients": args.clients, "distinct": args.distinct,
            "requests": dict(sorted(clients.counts.items())),
            "rss_mib_first_last": [samples[0][1], samples[-1][1]],
            "rss_mib_steady_min_max": [min(s[1] for s in steady), max(s[1] for s in steady)],
            "rss_mib_per_min": slope([(t, r) for t, r, _ in steady]),
            "fds_first_last": [samples[0][2], samples[-1][2]],
            "fds_per_min": slope([(t, float(f)) for t, _, f in steady]),
            "server_5xx": server_5xx, "tracebacks": text.count("Traceback"),
            "exit_code": code, "samples": samples, "server_log": str(log_path)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=1800.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--sample-s", type=float, default=15.0)
    parser.add_argument("--warmup", type=float, default=0.2, help="share of the run left out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--distinct", type=int, default=0,
                        help="draw prompts from this many fixed ones (0: every prompt new)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = run(args)
    done = sum(v for k, v in result["requests"].items() if ":client_error:" not in k)
    print(format_table(["metric", "value"], [
        ["requests (by outcome)", json.dumps(result["requests"])],
        ["requests done", done],
        ["RSS MiB first / last", result["rss_mib_first_last"]],
        ["RSS MiB after warm-up, min / max", result["rss_mib_steady_min_max"]],
        ["RSS slope after warm-up, MiB/min", round(result["rss_mib_per_min"], 3)],
        ["open fds first / last", result["fds_first_last"]],
        ["fd slope after warm-up, per min", round(result["fds_per_min"], 3)],
        ["server 5xx answers", result["server_5xx"]],
        ["tracebacks in the server log", result["tracebacks"]],
        ["exit code after SIGTERM", result["exit_code"]]]))
    if args.json:
        write_report(args.json, "soak_serve", result)


if __name__ == "__main__":
    main()
