"""What KV events cost the engine thread: events off vs on, side by side in one run.

Three measurements, each interleaving the modes round by round so drift on a shared machine hits
every mode alike:

- ``cycle``: one engine cycle on a ``TieredCache`` over a tiny layout (match, load, allocate,
  commit, release, poll; pools small enough that every cycle evicts, a memory store as the disk
  tier), timed on the engine (main) thread: wall time and the thread's own CPU time, median and
  p99 over all cycles.
- ``index``: the index alone (``RadixIndex`` with id pools, no bytes): one request's match, an
  allocation that evicts, the device insert and a host insert of its 8 pages, timed the same way;
  this isolates the per-transition cost of the observer hook.
- ``ttft``: time to first token of the CPU tiny model through ``EngineService`` (a fresh prompt:
  the miss path; the same prompt again: a device hit), median over the requests.

Modes: ``off`` (no observer on the index), ``on_absent`` (ZMQ publisher, nobody subscribed),
``on_slow`` (a SUB connected that never reads: the PUB queue fills to its high-water mark).

Run: ``python benchmarks/index/bench_events.py [--cycles 3000] [--requests 40] [--json out.json]``.
Needs pyzmq and msgpack (``pip install 'kvtier[events]'``). Main thread plus the engine and
publisher threads.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from kvtier.cache import TieredCache
from kvtier.config import build_config
from kvtier.events import KVEventFeed
from kvtier.keys import KeyNamespace
from kvtier.layout import KVLayout
from kvtier.machine import format_table, write_report
from kvtier.store.memory import MemoryStore

MODES = ("off", "on_absent", "on_slow")
P = 16
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", page_size=P)
NAMESPACE = KeyNamespace("bench-events", "fp0", "float32", LAYOUT.fingerprint(), P)


class SlowSubscriber:
    """A SUB socket that connects and never reads."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVHWM, 10)
        self.sock.connect(endpoint)

    def close(self) -> None:
        self.sock.close(linger=0)


def server_config(mode: str) -> Any:
    flags = {} if mode == "off" else {"server.kv_events_endpoint": "tcp://127.0.0.1:*"}
    return build_config(env={}, flags=flags).server


def make_cache() -> TieredCache:
    config = build_config(env={}, flags={"cache.page_size": P, "cache.device_pages": 48,
                                         "host.pool_bytes": 96 * LAYOUT.page_bytes,
                                         "controller.min_prefetch_tokens": 0,
                                         "controller.io_workers": 1})
    return TieredCache.build(config, LAYOUT, NAMESPACE,
                             stores={"disk": MemoryStore(LAYOUT.page_bytes)})


class CycleRig:
    """One cache (and its feed) per mode, driven one cycle at a time."""

    def __init__(self, mode: str, seed: int) -> None:
        self.cache = make_cache()
        self.feed = KVEventFeed.from_config(server_config(mode), self.cache.ctx.index)
        self.slow = SlowSubscriber(self.feed.publisher.endpoint) if mode == "on_slow" else None
        self.rng = random.Random(seed)
        self.heads = [[self.rng.randrange(1, 30000) for _ in range(4 * P)] for _ in range(8)]
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def cycle(self) -> None:
        tokens = self.rng.choice(self.heads) + [self.rng.randrange(1, 30000) for _ in range(4 * P)]
        w0, c0 = time.perf_counter(), time.thread_time()
        cache = self.cache
        loaded = cache.load(cache.match(tokens))
        held = dict(zip(range(loaded.start_tokens // P, loaded.tokens // P),
                        loaded.device_page_ids, strict=True))
        missing = [p for p in range(len(tokens) // P) if p not in held]
        held.update(zip(missing, cache.allocate(len(missing)), strict=True))
        cache.commit(tokens, [held[p] for p in sorted(held)])
        cache.release(loaded)
        cache.poll()
        self.cpu.append(time.thread_time() - c0)
        self.wall.append(time.perf_counter() - w0)

    def close(self) -> dict[str, Any]:
        stats = self.feed.stats() if self.feed is not None else None
        if self.feed is not None:
            self.feed.close()
        if self.slow is not None:
            self.slow.close()
        self.cache.close()
        return stats or {}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))]


def run_cycles(cycles: int, rig_type: Any = None) -> dict[str, Any]:
    rigs = {mode: (rig_type or CycleRig)(mode, seed=1) for mode in MODES}
    for _ in range(50):  # warm-up: fill the pools so every measured cycle evicts
        for rig in rigs.values():
            rig.cycle()
    for rig in rigs.values():
        rig.wall.clear()
        rig.cpu.clear()
    order = list(MODES)
    for i in range(cycles):
        for mode in order if i % 2 == 0 else reversed(order):
            rigs[mode].cycle()
    out = {}
    for mode, rig in rigs.items():
        out[mode] = {"wall_us_p50": pct(rig.wall, 0.5) * 1e6, "wall_us_p99": pct(rig.wall, 0.99) * 1e6,
                     "cpu_us_p50": pct(rig.cpu, 0.5) * 1e6, "cpu_us_mean":
                     statistics.fmean(rig.cpu) * 1e6, "cycles": len(rig.wall)}
        out[mode]["feed"] = rig.close()
    return out


class IndexRig:
    """A bookkeeping-only index (and its feed) per mode."""

    def __init__(self, mode: str, seed: int) -> None:
        from kvtier.index.radix import RadixIndex
        from kvtier.keys import page_keys

        self.page_keys = page_keys
        self.index = RadixIndex(P, capacities={"device": 64, "host": 256}, policies="lru")
        self.feed = KVEventFeed.from_config(server_config(mode), self.index)
        self.rng = random.Random(seed)
        self.heads = [[self.rng.randrange(1, 30000) for _ in range(4 * P)] for _ in range(8)]
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def cycle(self) -> None:
        tokens = self.rng.choice(self.heads) + [self.rng.randrange(1, 30000) for _ in range(4 * P)]
        keys = self.page_keys(tokens, P, NAMESPACE)
        w0, c0 = time.perf_counter(), time.thread_time()
        index = self.index
        depth = index.match(tokens).depth_of("device")
        ids = index.allocate("device", 8 - depth)
        index.free("device", index.insert(tokens, keys, tier="device", ids=ids, start=depth,
                                          strict=False).unused_ids)
        host_depth = index.match(tokens).depth_of("host")
        if host_depth < 8 and index.can_allocate("host", 8 - host_depth):
            hids = index.allocate("host", 8 - host_depth)
            index.free("host", index.insert(tokens, keys, tier="host", ids=hids, start=host_depth,
                                            strict=False).unused_ids)
        self.cpu.append(time.thread_time() - c0)
        self.wall.append(time.perf_counter() - w0)

    def close(self) -> dict[str, Any]:
        stats = self.feed.stats() if self.feed is not None else {}
        if self.feed is not None:
            self.feed.close()
        return stats


def run_ttft(requests: int) -> dict[str, Any]:
    from kvtier.bench.ttft import ttft
    from kvtier.engine.hf import load_model
    from kvtier.engine.service import EngineService

    lm = load_model("tiny-llama", device="cpu", dtype="float32", seed=0)
    services, slow = {}, None
    for mode in MODES:
        flags = {"engine.device": "cpu", "engine.dtype": "float32", "cache.page_size": P,
                 "cache.device_pages": 256, "host.pool_bytes": "16MiB"}
        if mode != "off":
            flags["server.kv_events_endpoint"] = "tcp://127.0.0.1:*"
        services[mode] = EngineService.build(build_config(env={}, flags=flags), lm=lm,
                                             max_running=1)
        if mode == "on_slow":
            slow = SlowSubscriber(services[mode].kv_events.publisher.endpoint)
    rng = random.Random(2)
    vocab = min(int(lm.config.vocab_size), 32000)
    samples: dict[str, dict[str, list[float]]] = {m: {"miss": [], "hit": []} for m in MODES}
    try:
        for i in range(requests):
            prompt = [rng.randrange(5, vocab) for _ in range(8 * P)]
            for mode in MODES if i % 2 == 0 else reversed(MODES):
                samples[mode]["miss"].append(ttft(services[mode], prompt)[0])
                samples[mode]["hit"].append(ttft(services[mode], prompt)[0])
    finally:
        for service in services.values():
            service.close()
        if slow is not None:
            slow.close()
    return {mode: {kind: statistics.median(v) * 1e3 for kind, v in by.items()}
            for mode, by in samples.items()}


def _vs(value: float, base: float) -> str:
    return f"{100 * (value / base - 1):+.1f}%"


def table(cycles: dict[str, Any], index_ops: dict[str, Any], ttfts: dict[str, Any]) -> str:
    rows = []
    for mode in MODES:
        c, i, t = cycles[mode], index_ops[mode], ttfts[mode]
        rows.append([mode, round(c["cpu_us_p50"], 1), _vs(c["cpu_us_p50"], cycles["off"]["cpu_us_p50"]),
                     round(c["wall_us_p50"], 1),
                     round(i["cpu_us_p50"], 2), _vs(i["cpu_us_p50"], index_ops["off"]["cpu_us_p50"]),
                     round(t["miss"], 2), _vs(t["miss"], ttfts["off"]["miss"]),
                     round(t["hit"], 2), _vs(t["hit"], ttfts["off"]["hit"])])
    return format_table(["mode", "cycle_cpu_us", "vs_off", "cycle_wall_us", "index_cpu_us",
                         "vs_off", "ttft_miss_ms", "vs_off", "ttft_hit_ms", "vs_off"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=3000)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--index-ops", type=int, default=20000)
    parser.add_argument("--json", default="benchmarks/results/events_cpu.json")
    args = parser.parse_args()
    cycles = run_cycles(args.cycles)
    index_ops = run_cycles(args.index_ops, IndexRig)
    ttfts = run_ttft(args.requests)
    print(table(cycles, index_ops, ttfts))
    path = write_report(args.json, "bench_events", {
        "args": vars(args), "page_size": P, "cycle": cycles, "index": index_ops,
        "ttft_ms": ttfts})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
