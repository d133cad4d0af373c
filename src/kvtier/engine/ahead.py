"""Greedy decode steps queued one step ahead, so the GPU does not wait for the engine thread.

Owns ``Chosen`` (one step's greedy tokens: on the device at once, on the host once copied),
``select_rows`` (rows of a device tensor, without waiting for the device) and ``Lookahead``
(the step queued ahead and the rules for taking its rows). In a run of greedy decode steps,
step i + 1 needs from the host only step i's tokens, and those are on the device as soon as
step i is queued. So ``Engine`` queues step i, its argmax and the copy of the tokens to the
host; then step i + 1 from an already captured decode graph, fed the tokens on the device
(``DecodeGraphs.launch``); and only then waits for step i's tokens and hands them out,
while the GPU runs step i + 1. The next ``Engine.step`` takes the rows step i + 1 computed
(``take``) instead of running them again, and queues step i + 2 the same way. The engine
thread's own time (emitting tokens, the scheduler's bookkeeping, planning, filling the graph's
inputs) then hides under the GPU's, where before it sat between two steps.

What keeps it exact and safe:

- A step goes ahead only if every row of the step now running reached its end (no prefill
  chunk is left half done) and is greedy and committed (its prompt's pages indexed: a commit may
  swap a sequence's pages for the index's copies), with no copy in flight into its pages. Rows
  that end at their token cap or the model's last position are left out of it.
- The step ahead writes the KV of each row's chosen token into that row's own next slot: the KV
  the next step would write there. A row whose sequence ends instead leaves that slot unread.
- Pages of a sequence in the step ahead go back to the pool only after that step completed
  (``settle``: ``Engine.finish`` and ``Engine.preempt`` wait for it): a page freed while the
  step is queued could be handed at once to a host tier's copy on another stream.
- A row of the next step is taken from the step ahead only if it is the same sequence at the
  same position, fed the token the engine chose, over the same pages; the others run their own
  forward (after the step ahead, on the same stream).

Engine thread only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.engine import paged


@dataclass
class Chosen:
    """The argmax of some rows' logits, on the device (``device``) and on its way to the host."""

    device: torch.Tensor
    host: torch.Tensor
    event: Any = None               # a CUDA event after the copy to ``host``; None on the CPU
    _tokens: list[int] | None = field(default=None, repr=False)

    @classmethod
    def of(cls, logits: torch.Tensor) -> Chosen:
        """Queue the argmax of ``logits`` ``[rows, vocab]`` and its copy to pinned memory."""
        device = torch.argmax(logits, -1)
        if device.device.type != "cuda":
            return cls(device, device)
        host = torch.empty(device.shape, dtype=device.dtype, pin_memory=True)
        host.copy_(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(device, host, event)

    def wait(self) -> None:
        """Until the tokens are on the host (and so every kernel queued before them ran)."""
        if self.event is not None:
            self.event.synchronize()

    def tokens(self) -> list[int]:
        if self._tokens is None:
            self.wait()
            self._tokens = self.host.tolist()
        return self._tokens


@dataclass(frozen=True)
class AheadRow:
    seq: Any                        # the ``runner.Sequence``
    start: int                      # the position its fed token was computed at
    pages: tuple[int, ...]          # the pages the step read and wrote


@dataclass
class Ahead:
    """A step queued ahead: its rows, the tokens it chose, and where its fed tokens came from."""

    rows: list[AheadRow]
    chosen: Chosen
    fed: Chosen
    fed_index: list[int]            # row k was fed ``fed.tokens()[fed_index[k]]``


class Lookahead:
    """Queues a greedy decode step ahead (``launch``), hands its rows to the next step
    (``take``) and makes sure nothing frees their pages under it (``settle``)."""

    def __init__(self, graphs: Any) -> None:
        self.graphs = graphs                # DecodeGraphs: only captured graphs serve a step ahead
        self.pending: Ahead | None = None
        self.counters = {"ahead_steps": 0, "ahead_rows_taken": 0, "ahead_rows_dropped": 0}

    def settle(self) -> None:
        """Wait until the step ahead, if any, completed (its rows stay there to be taken)."""
        if self.pending is not None:
            self.pending.chosen.wait()

    def take(self, planned: list[tuple[Any, paged.BatchRow]]
             ) -> tuple[dict[int, int], Ahead | None]:
        """Which of ``planned``'s rows the step ahead already computed: ``{index in planned:
        row of the step ahead}``, and that step (or ``{}, None``). The step ahead is consumed."""
        pending, self.pending = self.pending, None
        if pending is None:
            return {}, None
        fed = pending.fed.tokens()
        where = {id(row.seq): k for k, row in enumerate(pending.rows)}
        taken: dict[int, int] = {}
        for i, (seq, row) in enumerate(planned):
            k = where.get(id(seq))
            if k is None:
                continue
            ahead = pending.rows[k]
            if (row.start == ahead.start and len(row.tokens) == 1 and row.ticket is None
                    and row.tokens[0] == fed[pending.fed_index[k]]
                    and tuple(row.pages[:len(ahead.pages)]) == ahead.pages):
                taken[i] = k
        self.counters["ahead_rows_taken"] += len(taken)
        self.counters["ahead_rows_dropped"] += len(pending.rows) - len(taken)
        return taken, (pending if taken else None)

    def launch(self, rows: list[tuple[Any, paged.BatchRow]], pool: torch.Tensor,
               fed: Chosen, fed_index: list[int]) -> None:
        """Queue ``rows`` (one token each, fed ``fed.device[fed_index]``) through a captured
        decode graph; nothing is queued where none serves them."""
        ids = select_rows(fed.device, fed_index)
        logits = self.graphs.launch([row for _, row in rows], pool, ids, build=False)
        if logits is None:
            return
        page = int(pool.shape[3])
        self.pending = Ahead([AheadRow(seq, row.start, tuple(row.pages[:-(-row.end // page)]))
                              for seq, row in rows], Chosen.of(logits), fed, fed_index)
        self.counters["ahead_steps"] += 1


def select_rows(tensor: torch.Tensor, index: list[int]) -> torch.Tensor:
    """``tensor[index]`` without waiting for the device: the whole tensor when ``index`` takes
    every row in order, else the index uploaded from pinned memory (a blocking upload from
    pageable memory would wait for everything queued on the stream)."""
    if index == list(range(len(tensor))):
        return tensor
    cuda = tensor.device.type == "cuda"
    rows = torch.tensor(index, dtype=torch.long, pin_memory=cuda)
    return tensor[rows.to(tensor.device, non_blocking=cuda)]
