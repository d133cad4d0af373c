"""How soon the Redis store serves again after an outage, and what calls cost meanwhile.

One throwaway ``redis-server`` (no persistence, free loopback port) and, side by side on it, one
Redis store per breaker setting: the default cap on the breaker's backoff and the cap of earlier
releases (10 s). Each store has a caller thread writing one 64 KiB page every 20 ms, as an IO
worker under load would. For each outage length the server is stopped (``stop``: SIGTERM, then
started again on the same port) or stalled (``pause``: SIGSTOP, its connections stay open and
nothing answers, then SIGCONT), and the time from its first ``PONG`` to each store's first
acknowledged write is the recovery time. Also reported: the slowest call made while the store's
breaker was open (calls must answer at once), and how many calls waited the deadline out.

    python benchmarks/store/redis_recovery.py --outages 2,30 --modes stop,pause \
        --out benchmarks/results/redis_recovery

Main thread plus one caller thread per store.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtier.keys import KEY_BYTES
from kvtier.machine import format_table, write_report
from kvtier.store import open_store
from kvtier.store.redis import RedisStore

PAGE = 64 << 10
TICK_S = 0.02
SETTINGS = {"default cap (2 s)": {}, "earlier cap (10 s)": {"breaker_max_backoff_s": 10.0}}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class Server:
    """One redis-server that can be stopped and started again on its port."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start; returns the monotonic time of its first PONG."""
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + 10
        while not answers_ping(self.port):
            if time.monotonic() > end or self.process.poll() is not None:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.002)
        return time.monotonic()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a paused server must wake up to exit
            self.process.terminate()
            self.process.wait(timeout=10)
        self.process = None

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> float:
        """Wake a paused server; returns the monotonic time of its first PONG."""
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)
        while not answers_ping(self.port):
            time.sleep(0.002)
        return time.monotonic()


@contextlib.contextmanager
def own_server() -> Iterator[Server]:
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-recovery-"))
    server = Server(workdir)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


class Caller:
    """Writes one page every ``TICK_S`` and logs (start, seconds, acknowledged, breaker open)."""

    def __init__(self, store: RedisStore, name: str) -> None:
        self.store = store
        self.name = name
        self.log: list[tuple[float, float, bool, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"caller-{name}")
        self._key = os.urandom(KEY_BYTES)
        self._page = os.urandom(PAGE)

    def _run(self) -> None:
        while not self._stop.is_set():
            is_open = any(s != "closed" for s in self.store.breaker_states().values())
            start = time.monotonic()
            ok = self.store.write([self._key], [self._page]) == [True]
            self.log.append((start, time.monotonic() - start, ok, is_open))
            self._stop.wait(TICK_S)

    def __enter__(self) -> Caller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def one_outage(server: Server, callers: list[Caller], mode: str, outage_s: float,
               timeout_s: float) -> list[dict[str, Any]]:
    for caller in callers:
        caller.log.clear()
    time.sleep(1.0)  # serving before the outage
    down_at = time.monotonic()
    server.stop() if mode == "stop" else server.pause()
    time.sleep(outage_s)
    back_at = server.start() if mode == "stop" else server.resume()
    time.sleep(15.0)  # more than the earlier cap's worst case
    rows = []
    for caller in callers:
        during = [(s, sec, ok, op) for s, sec, ok, op in caller.log if down_at <= s < back_at]
        after = [s + sec for s, sec, ok, _ in caller.log if s >= back_at and ok]
        open_calls = [sec for _, sec, _, op in during if op]
        rows.append({
            "setting": caller.name, "mode": mode, "outage_s": outage_s,
            "recovery_s": (min(after) - back_at) if after else None,
            "calls_during_outage": len(during),
            "slowest_call_while_open_s": max(open_calls, default=None),
            "calls_waiting_half_the_deadline": sum(sec >= timeout_s / 2 for _, sec, _, _ in during),
            "acknowledged_during_outage": sum(ok for _, _, ok, _ in during)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outages", default="2,30", help="Outage lengths in seconds.")
    parser.add_argument("--modes", default="stop,pause", help="stop (server gone), pause "
                        "(server stalled: connections open, no answers), or both.")
    parser.add_argument("--out", default="benchmarks/results/redis_recovery",
                        help="Writes OUT.json (and prints the table).")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if not set(modes) <= {"stop", "pause"}:
        raise SystemExit(f"--modes: {args.modes!r}: each must be stop or pause")
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed (scripts/install_system_deps.sh)")
    rows: list[dict[str, Any]] = []
    with own_server() as server, contextlib.ExitStack() as stack:
        url = f"redis://127.0.0.1:{server.port}/0"
        callers = []
        for name, options in SETTINGS.items():
            store = stack.enter_context(open_store(url, page_bytes=PAGE, **options))
            assert isinstance(store, RedisStore)
            callers.append(stack.enter_context(Caller(store, name)))
        timeout_s = callers[0].store.options.timeout_s
        for mode in modes:
            for outage_s in (float(x) for x in args.outages.split(",")):
                rows += one_outage(server, callers, mode, outage_s, timeout_s)
    headers = ["setting", "mode", "outage s", "recovery s", "calls", "slowest open call s",
               "calls >= deadline/2"]
    table = format_table(headers, [[r["setting"], r["mode"], r["outage_s"], r["recovery_s"],
                                    r["calls_during_outage"], r["slowest_call_while_open_s"],
                                    r["calls_waiting_half_the_deadline"]] for r in rows])
    print(table)
    options = callers[0].store.options
    write_report(f"{args.out}.json", "redis_recovery", {
        "rows": rows, "page_bytes": PAGE, "tick_s": TICK_S,
        "options": {"timeout_s": options.timeout_s, "breaker_failures": options.breaker_failures,
                    "breaker_backoff_s": options.breaker_backoff_s},
        "settings": SETTINGS, "load_avg": os.getloadavg()})
    Path(f"{args.out}.txt").write_text(table + "\n")
    worst = max((r["recovery_s"] or float("inf")) for r in rows if r["setting"] == "default cap (2 s)")
    print(f"worst recovery with the default cap: {worst:.2f} s (goal: <= 5 s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
