"""Synthetic workloads of other shapes, in the trace format, to check policies off the real trace.

Owns four generators, each seeded and deterministic:

- ``chat``: multi-turn sessions under a few shared system prompts; a session continues with a
  fixed probability after a think time; every turn appends the answer and a new message.
- ``rag``: one-shot questions over a shared document set with Zipf popularity (reuse is by
  frequency, not by session).
- ``agent``: tool-calling loops: long shared tool prompts, many quick steps per task, each step
  appending a tool result.
- ``scan``: a Zipf-popular hot set of long prefixes under a steady stream of one-off long
  documents that are never seen again (the pattern that flushes an LRU cache).
- ``multiturn``: prefix-chained conversations whose chance to continue falls with each turn
  (most come back once, quickly; few come back twice), so a page that returned is *less*
  likely to return again than a fresh one — the opposite of ``chat``, and the shape that
  punishes a policy which protects returned pages.
- ``short``: many short sessions (one or two turns) with quick replies under one system prompt.
- ``system``: a few long shared system prompts (Zipf) under one-shot user messages, a third of
  which ask one follow-up.
- ``hinted``: a few long documents asked about every ``reuse_s`` with a cache hint
  (``prompt_cache_retention: in_memory``), under a flood of one-off prompts that fills the
  cache many times between two uses: the workload that shows what hints are for.

Content is modelled as segments (an id and a token length); a block's id names its exact content
(which segments and offsets it covers) and its parent block, so ids form prefix chains as in a
real trace, and a partial last block gets a new id once its request grows. Main thread.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.hints import CacheHint, openai_hint
from kvtier.replay.trace import Trace, TraceRequest

Segment = tuple[int, int]  # (segment id, tokens)


class BlockNamer:
    """Gives every distinct (parent block, block content) one integer id."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._ids: dict[tuple[object, ...], int] = {}
        self._segments = 0

    def segment(self, tokens: int) -> Segment:
        """A new piece of content nobody has seen before."""
        self._segments += 1
        return (self._segments, max(int(tokens), 1))

    def blocks(self, segments: list[Segment]) -> tuple[int, ...]:
        out: list[int] = []
        piece: list[tuple[int, int, int]] = []
        room = self.block_tokens
        for seg_id, length in segments:
            offset = 0
            while offset < length:
                take = min(room, length - offset)
                piece.append((seg_id, offset, offset + take))
                offset += take
                room -= take
                if room == 0:
                    out.append(self._name(out, piece))
                    piece, room = [], self.block_tokens
        if piece:
            out.append(self._name(out, piece))
        return tuple(out)

    def _name(self, done: list[int], piece: list[tuple[int, int, int]]) -> int:
        key = (done[-1] if done else -1, *piece)
        return self._ids.setdefault(key, len(self._ids))


@dataclass(frozen=True)
class Shape:
    """Common knobs: how many requests, over how long, with which seed and block size."""

    requests: int = 4000
    duration_s: float = 1800.0
    seed: int = 0
    block_tokens: int = 512


def _lognormal(rng: random.Random, median: float, sigma: float = 0.8) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


def _zipf_picker(rng: random.Random, n: int, s: float) -> Callable[[], int]:
    weights = [1.0 / (i + 1) ** s for i in range(n)]
    cumulative, total = [], 0.0
    for w in weights:
        total += w
        cumulative.append(total)
    return lambda: min(_bisect(cumulative, rng.random() * total), n - 1)


def _bisect(values: list[float], x: float) -> int:
    lo, hi = 0, len(values)
    while lo < hi:
        mid = (lo + hi) // 2
        if values[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _request(namer: BlockNamer, t_s: float, segments: list[Segment], output: int,
             hint: CacheHint | None = None) -> TraceRequest:
    return TraceRequest(int(t_s * 1000), sum(n for _, n in segments), output,
                        namer.blocks(segments), hint)


def _finish(name: str, shape: Shape, requests: list[TraceRequest]) -> Trace:
    requests.sort(key=lambda r: r.timestamp_ms)
    return Trace(tuple(requests[:shape.requests]), shape.block_tokens, name)


def _sessions(shape: Shape, name: str, prompts: list[Segment], pick_prompt: Callable[[], int],
              rng: random.Random, namer: BlockNamer, step: Callable[[], tuple[int, int, float]],
              p_continue: float, first_tokens: float) -> Trace:
    """Sessions that start at random times and grow turn by turn until they stop."""
    requests: list[TraceRequest] = []
    while len(requests) < shape.requests * 1.2:
        t = rng.uniform(0.0, shape.duration_s)
        context = [prompts[pick_prompt()], namer.segment(_lognormal(rng, first_tokens))]
        while t < shape.duration_s:
            answer, message, think = step()
            requests.append(_request(namer, t, context, answer))
            if rng.random() > p_continue:
                break
            context = [*context, namer.segment(answer), namer.segment(message)]
            t += think
    return _finish(name, shape, requests)


def chat(shape: Shape = Shape(), p_continue: float = 0.55, think_s: float = 90.0,
         name: str = "synthetic-chat") -> Trace:
    rng, namer = random.Random(shape.seed), BlockNamer(shape.block_tokens)
    prompts = [namer.segment(rng.choice((600, 1200, 2500))) for _ in range(8)]
    pick = _zipf_picker(rng, len(prompts), 1.0)

    def step() -> tuple[int, int, float]:
        return (int(_lognormal(rng, 350)), int(_lognormal(rng, 250, 1.2)),
                _lognormal(rng, think_s, 1.0))

    return _sessions(shape, name, prompts, pick, rng, namer, step, p_continue, 3000)


def agent(shape: Shape = Shape(), p_continue: float = 0.93, step_s: float = 6.0) -> Trace:
    rng, namer = random.Random(shape.seed + 1), BlockNamer(shape.block_tokens)
    prompts = [namer.segment(rng.choice((4000, 8000))) for _ in range(4)]
    pick = _zipf_picker(rng, len(prompts), 0.8)

    def step() -> tuple[int, int, float]:
        return (int(_lognormal(rng, 150)), int(_lognormal(rng, 900, 1.0)),
                _lognormal(rng, step_s, 0.7))

    return _sessions(shape, "synthetic-agent", prompts, pick, rng, namer, step, p_continue, 600)


def rag(shape: Shape = Shape(), documents: int = 2000, zipf_s: float = 0.9) -> Trace:
    rng, namer = random.Random(shape.seed + 2), BlockNamer(shape.block_tokens)
    system = namer.segment(800)
    docs = [namer.segment(_lognormal(rng, 6000, 0.6)) for _ in range(documents)]
    pick = _zipf_picker(rng, documents, zipf_s)
    times = sorted(rng.uniform(0.0, shape.duration_s) for _ in range(shape.requests))
    requests = [_request(namer, t, [system, docs[pick()], namer.segment(_lognormal(rng, 120))],
                         int(_lognormal(rng, 200))) for t in times]
    return _finish("synthetic-rag", shape, requests)


def scan(shape: Shape = Shape(), hot: int = 300, zipf_s: float = 1.1,
         scan_share: float = 0.5) -> Trace:
    rng, namer = random.Random(shape.seed + 3), BlockNamer(shape.block_tokens)
    prefixes = [namer.segment(_lognormal(rng, 3000, 0.5)) for _ in range(hot)]
    pick = _zipf_picker(rng, hot, zipf_s)
    times = sorted(rng.uniform(0.0, shape.duration_s) for _ in range(shape.requests))
    requests = []
    for t in times:
        if rng.random() < scan_share:
            segments = [namer.segment(_lognormal(rng, 12000, 0.5))]
        else:
            segments = [prefixes[pick()], namer.segment(_lognormal(rng, 150))]
        requests.append(_request(namer, t, segments, int(_lognormal(rng, 200))))
    return _finish("synthetic-scan", shape, requests)


def multiturn(shape: Shape = Shape(), p_first: float = 0.85, fading: float = 0.45,
              think_s: float = 40.0) -> Trace:
    """Continue after turn ``k`` (1-based) with probability ``p_first * fading ** (k - 1)``."""
    rng, namer = random.Random(shape.seed + 4), BlockNamer(shape.block_tokens)
    system = namer.segment(700)
    requests: list[TraceRequest] = []
    while len(requests) < shape.requests * 1.2:
        t = rng.uniform(0.0, shape.duration_s)
        context = [system, namer.segment(_lognormal(rng, 2500))]
        turn = 1
        while t < shape.duration_s:
            answer = int(_lognormal(rng, 400))
            requests.append(_request(namer, t, context, answer))
            if rng.random() > p_first * fading ** (turn - 1):
                break
            context = [*context, namer.segment(answer), namer.segment(_lognormal(rng, 300))]
            t += _lognormal(rng, think_s * turn, 0.8)
            turn += 1
    return _finish("synthetic-multiturn", shape, requests)


def short(shape: Shape = Shape()) -> Trace:
    """Many one- or two-turn sessions with quick replies (``chat`` with little continuation)."""
    return chat(shape, p_continue=0.25, think_s=20.0, name="synthetic-short")


def system(shape: Shape = Shape(), prompts: int = 24, zipf_s: float = 1.0,
           p_follow: float = 0.33) -> Trace:
    rng, namer = random.Random(shape.seed + 5), BlockNamer(shape.block_tokens)
    heads = [namer.segment(_lognormal(rng, 3000, 0.5)) for _ in range(prompts)]
    pick = _zipf_picker(rng, prompts, zipf_s)
    requests = []
    for t in sorted(rng.uniform(0.0, shape.duration_s) for _ in range(shape.requests)):
        context = [heads[pick()], namer.segment(_lognormal(rng, 200))]
        answer = int(_lognormal(rng, 250))
        requests.append(_request(namer, t, context, answer))
        if rng.random() < p_follow:
            follow = [*context, namer.segment(answer), namer.segment(_lognormal(rng, 150))]
            requests.append(_request(namer, t + _lognormal(rng, 60.0), follow, answer))
    return _finish("synthetic-system", shape, requests)


def hinted(shape: Shape = Shape(), documents: int = 4, reuse_s: float = 90.0,
           hints: bool = True) -> Trace:
    """``documents`` of 6k tokens, each asked about every ``reuse_s`` (hinted when ``hints``),
    and one-off prompts of ~4k tokens for the rest of the requests."""
    rng, namer = random.Random(shape.seed + 6), BlockNamer(shape.block_tokens)
    docs = [namer.segment(6000) for _ in range(documents)]
    requests = []
    for i, doc in enumerate(docs):
        hint = openai_hint(f"doc-{i}", "in_memory") if hints else None
        t = rng.uniform(0.0, reuse_s)
        while t < shape.duration_s:
            requests.append(_request(namer, t, [doc, namer.segment(100)], 200, hint))
            t += reuse_s
    while len(requests) < shape.requests:
        requests.append(_request(namer, rng.uniform(0.0, shape.duration_s),
                                 [namer.segment(_lognormal(rng, 4000, 0.4))], 200))
    return _finish("synthetic-hinted" if hints else "synthetic-unhinted", shape, requests)


GENERATORS: dict[str, Callable[[Shape], Trace]] = {
    "chat": chat, "agent": agent, "rag": rag, "scan": scan, "multiturn": multiturn,
    "short": short, "system": system}


def make(name: str, shape: Shape = Shape()) -> Trace:
    """A synthetic trace by generator name."""
    if name not in GENERATORS:
        from kvtier.errors import ConfigError

        raise ConfigError("synthetic workload", name, ", ".join(GENERATORS))
    return GENERATORS[name](shape)
