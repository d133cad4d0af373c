"""Where one step's prompt rows meet FlashAttention 3: keys cut into fixed segments, on the host.

Owns ``segment_for``, ``Launch``, ``FullPass``, ``Plan`` and the builders ``plan_step`` (a
batched step's rows) and ``plan_suffix`` (a captured suffix step's one row, padded to its
static shapes), and ``StaticPlan`` (a captured step's plan in one device buffer).
``paged_fa3.attend`` runs what they describe.

Why segments: FA3 run without splitting a row's keys (what keeps a row's bits independent of
the batch and of how its prompt was cut into steps) gives a hit's few new tokens a handful of
programs per KV head, each walking tens of thousands of keys alone: 0.43 ms a layer for 17
tokens over 32k keys on an H100, where a split launch would take a tenth. Split launches sum a
row's keys in an order that depends on the launch; here the cut is a property of the keys
alone. Key positions are cut every ``segment_for`` (``SEGMENT_TOKENS`` rounded down to whole
pages); a query at position ``p`` then sees the segments before its own whole (one
non-causal launch: every (row, full segment) is an FA3 entry over a gathered copy of the
queries that see it whole) and its own segment up to itself (one causal launch over the step's
queries in place, an entry per (row, segment its tokens fall in)). ``paged_fa3_merge`` folds
the results in segment order. What a row computes depends on its position and keys only, so a
prompt whole, in chunks or as a hit's suffix gets the same bits (``tests/test_paged_fa3_gpu.py``),
and a row before the first cut (``p < segment``: every prompt of up to 8k tokens) is one causal
FA3 entry, as without segments.

``SEGMENT_TOKENS`` = 8192 trades the two ends of the same 32k prompt on an H100 (8B model,
``benchmarks/engine/engine_vs_vllm.py``): a hit's suffix at 32k runs on 4x the programs per
KV head; a prefill row past the first cut pays a gathered query and a partial output
(``2 x heads x head_dim`` values) per full segment behind it, and the merge, about 2% of a 32k
recompute's time. Halving it doubles that cost for a suffix launch half as long; doubling it
halves both. ``PASS_PARTIALS`` bounds the partials one launch holds (256 MiB of gathered
queries and as much output for an 8B model's 32 heads of 128): a long chunk far into a long
prompt runs as several passes, which changes no row's sums. Engine thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

#: Key positions in a segment (see the module docstring for how it was chosen).
SEGMENT_TOKENS = 8192
#: Most (row, full segment) partials one non-causal launch computes.
PASS_PARTIALS = 32768


def segment_for(page_size: int) -> int:
    """``SEGMENT_TOKENS`` rounded down to whole pages (at least one page)."""
    return max(1, SEGMENT_TOKENS // page_size) * page_size


@dataclass
class Launch:
    """One FA3 launch's entries: ``cu_q`` (each entry's first query, then the end),
    ``seqused`` (the keys each entry sees), ``table`` (each entry's pages from its first key)
    and the most queries an entry holds."""

    cu_q: torch.Tensor
    seqused: torch.Tensor
    table: torch.Tensor
    max_q: int


@dataclass
class FullPass:
    """A non-causal launch over gathered queries (``gather``: the step's query indices) and the
    merge of its partials: ``rows`` to fold, ``parts`` ``[rows, K]`` their partials' indices,
    ``counts`` how many are real."""

    gather: torch.Tensor
    launch: Launch
    rows: torch.Tensor
    parts: torch.Tensor
    counts: torch.Tensor


@dataclass
class Plan:
    """A step's FA3 work: the causal launch over each row's own segment(s), then passes."""

    own: Launch
    passes: list[FullPass]
    segment: int
    any: bool


@dataclass
class _Entries:
    starts: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    tables: list[Sequence[int]] = field(default_factory=list)
    max_q: int = 1

    def add(self, first: int, count: int, keys: int, pages: Sequence[int]) -> None:
        self.starts.append(first)
        self.keys.append(keys)
        self.tables.append(pages)
        self.max_q = max(self.max_q, count)

    def host(self, end: int, width: int, entries: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cu_q, seqused, table) int32, padded to ``entries`` empty entries at ``end``."""
        n = len(self.starts) if entries is None else entries
        if n < len(self.starts):
            raise ValueError(f"{len(self.starts)} FA3 entries exceed the {n} held")
        cu_q = torch.full((n + 1,), end, dtype=torch.int32)
        cu_q[:len(self.starts)] = torch.as_tensor(self.starts, dtype=torch.int32)
        seqused = torch.zeros(n, dtype=torch.int32)
        seqused[:len(self.keys)] = torch.as_tensor(self.keys, dtype=torch.int32)
        table = torch.zeros((n, width), dtype=torch.int32)
        for i, pages in enumerate(self.tables):
            table[i, :len(pages)] = torch.as_tensor(list(pages), dtype=torch.int32)
        return cu_q, seqused, table


@dataclass
class _Pass:
    entries: _Entries = field(default_factory=_Entries)
    gather: list[torch.Tensor] = field(default_factory=list)
    size: int = 0
    rows: list[torch.Tensor] = field(default_factory=list)
    parts: list[torch.Tensor] = field(default_factory=list)
    counts: list[torch.Tensor] = field(default_factory=list)

    def add_slice(self, q_first: int, start: int, first: int, stop: int, pages: Sequence[int],
                  segment: int, page_size: int) -> None:
        """Positions ``first .. stop`` of a row (its tokens from ``start``, query index
        ``q_first``): an entry per full segment behind them, their rows to fold."""
        per_segment = segment // page_size
        full = (stop - 1) // segment
        lows, bases = [], []
        for s in range(full):
            low = max(first, (s + 1) * segment)
            lows.append(low)
            bases.append(self.size)
            self.entries.add(self.size, stop - low, segment,
                             pages[s * per_segment:(s + 1) * per_segment])
            self.gather.append(torch.arange(q_first + low - start, q_first + stop - start))
            self.size += stop - low
        positions = torch.arange(max(first, segment), stop)
        if not positions.numel():
            return
        behind = positions // segment
        parts = torch.zeros((positions.numel(), full), dtype=torch.int32)
        for s, (low, base) in enumerate(zip(lows, bases, strict=True)):
            parts[:, s] = torch.where(behind > s, base + positions - low, 0)
        self.rows.append(q_first + positions - start)
        self.parts.append(parts)
        self.counts.append(behind.to(torch.int32))

    def build(self, device: torch.device, width: int, *, entries: int | None = None,
              gathered: int | None = None, merged: int | None = None,
              depth: int | None = None) -> FullPass:
        """Device tensors, padded to static sizes where given (a captured step: ``entries``
        FA3 entries, ``gathered`` queries, every one of ``merged`` rows folded, ``depth``
        partials a row)."""
        cu_q, seqused, table = self.entries.host(self.size, width, entries)
        gather = torch.cat(self.gather) if self.gather else torch.zeros(0, dtype=torch.long)
        if gathered is not None:
            gather = torch.cat([gather, torch.zeros(gathered - gather.numel(),
                                                    dtype=torch.long)])
        rows = torch.cat(self.rows) if self.rows else torch.zeros(0, dtype=torch.long)
        counts = torch.cat(self.counts) if self.counts else torch.zeros(0, dtype=torch.int32)
        depth = max((p.shape[1] for p in self.parts), default=1) if depth is None else depth
        parts = torch.zeros((rows.numel(), max(depth, 1)), dtype=torch.int32)
        at = 0
        for block in self.parts:
            parts[at:at + block.shape[0], :block.shape[1]] = block
            at += block.shape[0]
        if merged is not None:   # a captured step's merge visits every row (count 0: kept)
            whole = torch.zeros((merged, parts.shape[1]), dtype=torch.int32)
            every = torch.zeros(merged, dtype=torch.int32)
            whole[rows] = parts
            every[rows] = counts
            rows, parts, counts = torch.arange(merged), whole, every
        return FullPass(gather.to(device),
                        Launch(cu_q.to(device), seqused.to(device), table.to(device),
                               self.entries.max_q),
                        rows.to(device=device, dtype=torch.int32), parts.to(device),
                        counts.to(device))


def _own_entries(entries: _Entries, q_first: int, start: int, end: int, pages: Sequence[int],
                 segment: int, page_size: int) -> None:
    """A prompt row's tokens cut where its positions cross a segment: each piece a causal
    entry over its own segment's keys up to the piece's last token."""
    per_segment = segment // page_size
    for s in range(start // segment, (end - 1) // segment + 1):
        low, high = max(start, s * segment), min(end, (s + 1) * segment)
        keys = high - s * segment
        entries.add(q_first + low - start, high - low, keys,
                    pages[s * per_segment:s * per_segment + -(-keys // page_size)])


def plan_step(rows: Sequence[Any], q_starts: Sequence[int], page_size: int,
              device: torch.device) -> Plan:
    """The plan of a batched step's rows (``paged.BatchRow``; ``q_starts`` their first query
    in the step). A decode row gets an empty entry: the split-KV kernel serves it."""
    segment = segment_for(page_size)
    width = segment // page_size
    own = _Entries()
    passes = [_Pass()]
    for row, q_first in zip(rows, q_starts, strict=True):
        if row.decode:
            own.add(q_first, 1, 0, ())
            continue
        _own_entries(own, q_first, row.start, row.end, row.pages, segment, page_size)
        first = max(row.start, segment)
        while first < row.end:   # slices within one segment: each position has `behind` parts
            behind = first // segment
            room = (PASS_PARTIALS - passes[-1].size) // behind
            if room == 0 and passes[-1].size:
                passes.append(_Pass())
                continue
            stop = min(row.end, (behind + 1) * segment, first + max(room, 1))
            passes[-1].add_slice(q_first, row.start, first, stop, row.pages, segment,
                                 page_size)
            first = stop
    total = sum(len(row.tokens) for row in rows)
    cu_q, seqused, table = own.host(total, width)
    return Plan(Launch(cu_q.to(device), seqused.to(device), table.to(device), own.max_q),
                [p.build(device, width) for p in passes if p.size], segment,
                not all(row.decode for row in rows))


def suffix_shapes(bucket: int, capacity_tokens: int, page_size: int) -> dict[str, int]:
    """The static sizes of a captured step of ``bucket`` tokens whose row ends within
    ``capacity_tokens``: its own entries (a bucket crosses at most one cut), full entries,
    gathered queries and partials a row."""
    segment = segment_for(page_size)
    if bucket > segment:
        raise ValueError(f"a captured step of {bucket} tokens exceeds a segment of {segment}")
    full = max(1, (capacity_tokens - 1) // segment)
    return {"own": 2, "entries": full, "gathered": full * bucket, "depth": full}


def plan_suffix(row: Any, bucket: int, capacity_tokens: int, page_size: int) -> Plan:
    """The host-side plan of a captured step of one row (None: padding only), padded to shapes
    that depend on ``bucket`` and ``capacity_tokens`` only (``suffix_shapes``), so that it
    copies into the step's static one (``StaticPlan``); each launch bounded by ``bucket``
    queries an entry."""
    host = torch.device("cpu")
    segment = segment_for(page_size)
    width = segment // page_size
    shapes = suffix_shapes(bucket, capacity_tokens, page_size)
    own, full = _Entries(), _Pass()
    count = len(row.tokens) if row is not None else 0
    if count:
        _own_entries(own, 0, row.start, row.end, row.pages, segment, page_size)
        if (row.end - 1) // segment:
            full.add_slice(0, row.start, max(row.start, segment), row.end, row.pages,
                           segment, page_size)
    cu_q, seqused, table = own.host(count, width, shapes["own"])
    passed = full.build(host, width, entries=shapes["entries"], gathered=shapes["gathered"],
                        merged=bucket, depth=shapes["depth"])
    passed.launch.max_q = bucket
    return Plan(Launch(cu_q, seqused, table, bucket), [passed], segment, count > 0)


class StaticPlan:
    """A captured step's plan: ``plan``'s tensors are views of one int32 device buffer, so
    ``fill`` writes a row's whole plan with one host-to-device copy."""

    #: Each tensor's place in the buffer starts at a multiple of this many int32 (128 bytes).
    ALIGN = 32

    def __init__(self, bucket: int, capacity_tokens: int, page_size: int,
                 device: torch.device) -> None:
        self.shape = (bucket, capacity_tokens, page_size)
        host = plan_suffix(None, bucket, capacity_tokens, page_size)
        self.flat = self._flat(host).to(device)
        views, at = [], 0
        for tensor in _tensors(host):
            views.append(self.flat[at:at + tensor.numel()].view(tensor.shape))
            at += -(-tensor.numel() // self.ALIGN) * self.ALIGN
        own = Launch(views[0], views[1], views[2], bucket)
        v = views[3:]
        full = FullPass(v[0], Launch(v[1], v[2], v[3], bucket), v[4], v[5], v[6])
        self.plan = Plan(own, [full], host.segment, True)

    def fill(self, row: Any) -> None:
        """Write ``row``'s plan (None: padding only)."""
        self.flat.copy_(self._flat(plan_suffix(row, *self.shape)))

    def _flat(self, host: Plan) -> torch.Tensor:
        pieces = []
        for tensor in _tensors(host):
            piece = torch.zeros(-(-tensor.numel() // self.ALIGN) * self.ALIGN, dtype=torch.int32)
            piece[:tensor.numel()] = tensor.reshape(-1)
            pieces.append(piece)
        return torch.cat(pieces)


def _tensors(plan: Plan) -> list[torch.Tensor]:
    """A one-pass plan's tensors in ``StaticPlan``'s order."""
    (full,) = plan.passes
    return [plan.own.cu_q, plan.own.seqused, plan.own.table, full.gather, full.launch.cu_q,
            full.launch.seqused, full.launch.table, full.rows, full.parts, full.counts]
