"""Continuous batching: every running sequence advances in one forward per step.

Owns ``Engine`` and ``Sequence``. ``admit`` gives a request (or a preempted sequence coming
back) its page table: the prompt's cache hit, in place in the device pool (``seq_pages``).
``step`` then plans one forward over every running sequence: a decode is one token (the last
one chosen), a prefill a chunk of its prompt, the chunks of all prefills sharing
``chunk_tokens`` per step (oldest first), so a long prompt does not stall the decodes around
it; each sequence's pages grow to hold its new tokens, and when the device pool runs out the
newest sequence is preempted (its computed full pages committed to the cache, everything
released: it comes back as a prefix hit, or a plain recompute without the cache). One
``paged.forward_batch`` runs the step (a step of decodes only replays a captured graph,
``decode_graphs``, where one serves it; a step of one fresh hit's suffix alone, ``suffix_step``).
A sequence whose hit is still crossing the bus from the host tier waits out of the steps while
others can run, so their decodes do not stall behind its copy; alone, it steps at once and its
forward waits layer by layer for the copy. Rows that reached their last token get their next
token chosen and sent, and a prompt's pages are committed once its first token is out. ``finish``
commits the sequence's KV pages and releases what it pinned. Engine thread only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.engine import paged
from kvtier.engine.ahead import Chosen, Lookahead, select_rows
from kvtier.engine.hf import CausalLM
from kvtier.engine.prefix import MIN_OBSERVED_PREFILL_TOKENS
from kvtier.engine.request import FinishEvent, PrefillReport, RequestHandle, TokenEvent
from kvtier.engine.sampling import Sampler
from kvtier.engine.seq_pages import SeqPages
from kvtier.engine.suffix_step import SuffixStep
from kvtier.errors import PoolExhausted

#: Prompt tokens all prefills of one step run at most by default (``engine.prefill_chunk_tokens``).
DEFAULT_CHUNK_TOKENS = 512


@dataclass
class Sequence:
    """A request being generated: its tokens, its pages and how far its KV is computed."""

    handle: RequestHandle
    kv: Any                        # SeqPages while admitted, None while queued or done
    sampler: Sampler
    tokens: list[int]              # prompt, then generated tokens
    report: PrefillReport
    generated: int = 0
    computed: int = 0              # tokens whose KV the pages hold
    admitted_at: float = 0.0
    committed: bool = False        # the prompt's pages went to the cache (first token out)
    started_at: float = field(default_factory=time.perf_counter)

    @property
    def request(self) -> Any:
        return self.handle.request


@dataclass
class StepResult:
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)


def _loading(seq: Sequence) -> bool:
    """Whether ``seq``'s hit is still being copied into its pages (a host load in flight)."""
    ticket = seq.kv.ticket if seq.kv is not None else None
    is_done = getattr(ticket, "is_done", None)
    return is_done is not None and not is_done()


class Engine:
    """Runs batched steps of one ``CausalLM`` over pages from ``pages`` (``seq_pages``)."""

    def __init__(self, lm: CausalLM, pages: Any, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 prefix_cache: Any = None, decode_graphs: Any = None,
                 suffix: SuffixStep | None = None, lookahead: Lookahead | None = None) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.lm, self.pages, self.chunk_tokens = lm, pages, chunk_tokens
        self.prefix_cache = prefix_cache   # observes cold prefill rates for the split
        self.suffix = suffix                 # a lone fresh hit's suffix replays captured graphs
        self.decode_graphs = decode_graphs   # DecodeGraphs: all-decode steps replay a graph
        self.lookahead = lookahead           # greedy decode steps queued one step ahead
        self.counters = {"steps": 0, "batched_tokens": 0, "preempted": 0,
                         "deferred_for_load": 0}

    # ---- admission -------------------------------------------------------------------------
    def admit(self, item: RequestHandle | Sequence) -> Sequence:
        """A new request's sequence (its KV's cached part in place), or a preempted one back."""
        if isinstance(item, Sequence):
            item.kv, item.computed = self.pages.open(item.tokens, item.request.salt,
                                                     PrefillReport(len(item.tokens)))
            return item
        request = item.request
        prompt = list(request.prompt_ids)
        if len(prompt) >= self.lm.max_positions:
            raise ValueError(f"{len(prompt)} prompt tokens leave no room in the model's "
                             f"{self.lm.max_positions} positions")
        now = time.perf_counter()
        report = PrefillReport(prompt_tokens=len(prompt), queue_s=now - item.submitted_at)
        seq = Sequence(item, None, Sampler(request.sampling), prompt, report, admitted_at=now)
        seq.kv, seq.computed = self.pages.open(prompt, request.salt, report)
        return seq

    # ---- one step --------------------------------------------------------------------------
    def step(self, running: list[Sequence]) -> StepResult:
        """One forward for every sequence in ``running`` (oldest first) that can advance."""
        result = StepResult()
        planned: list[tuple[Sequence, paged.BatchRow]] = []
        budget = self.chunk_tokens
        defer = any(seq.kv is not None and not _loading(seq) for seq in running)
        for seq in running:
            if seq in result.preempted:
                continue
            if defer and _loading(seq):   # the others step on while its pages cross the bus
                self.counters["deferred_for_load"] += 1
                continue
            count = self._tokens_this_step(seq, budget)
            if count == 0:
                continue
            if not self._make_room(seq, count, running, planned, result):
                continue
            budget -= count if count > 1 or len(seq.tokens) - seq.computed > 1 else 0
            start = seq.computed
            planned.append((seq, paged.BatchRow(seq.kv.table, start,
                                                seq.tokens[start:start + count], seq.kv.ticket,
                                                start < seq.report.prompt_tokens)))
        if planned:
            self._run(planned, result)
        return result

    def _tokens_this_step(self, seq: Sequence, budget: int) -> int:
        pages: SeqPages = seq.kv
        if pages.tail is not None and seq.computed >= pages.tail[1]:
            seq.computed = self.pages.load_tail(pages, len(seq.tokens), seq.report)
        remaining = len(seq.tokens) - seq.computed
        if remaining <= 1:
            return remaining
        count = min(remaining, budget)
        if pages.tail is not None:
            count = min(count, pages.tail[1] - seq.computed)
        return max(count, 0)

    def _make_room(self, seq: Sequence, count: int, running: list[Sequence],
                   planned: list[tuple[Sequence, paged.BatchRow]], result: StepResult) -> bool:
        """Grow ``seq``'s pages for ``count`` more tokens, preempting the newest sequences
        while the pool is short; False if ``seq`` itself had to go."""
        while True:
            try:
                self.pages.grow(seq.kv, seq.computed + count)
                return True
            except PoolExhausted as exc:
                victims = [s for s in running if s not in result.preempted and s.kv is not None]
                victim = victims[-1]
                if victim is seq and len(victims) == 1:
                    result.failed.append((seq, exc))
                    return False
                self.preempt(victim)
                result.preempted.append(victim)
                planned[:] = [(s, row) for s, row in planned if s is not victim]
                if victim is seq:
                    return False

    def _run(self, planned: list[tuple[Sequence, paged.BatchRow]], result: StepResult) -> None:
        started = time.perf_counter()
        taken, ahead = self.lookahead.take(planned) if self.lookahead is not None else ({}, None)
        rest = [i for i in range(len(planned)) if i not in taken]
        logits = None
        if rest:
            try:
                logits = self._forward([planned[i] for i in rest])
            except Exception as exc:  # the step's sequences fail; the engine keeps serving
                result.failed += [(planned[i][0], exc) for i in rest]
                if not taken:
                    return
                planned = [planned[i] for i in sorted(taken)]
                taken = {j: taken[i] for j, i in enumerate(sorted(taken))}
                rest = []
        self.counters["steps"] += 1
        self.counters["batched_tokens"] += len(taken) + sum(len(planned[i][1].tokens)
                                                            for i in rest)
        done = [i for i, (seq, row) in enumerate(planned) if row.end == len(seq.tokens)]
        local = {i: j for j, i in enumerate(rest)}        # a rest row's row in ``logits``
        greedy = [i for i in done if i in local and planned[i][0].sampler.params.greedy]
        chosen = Chosen.of(select_rows(logits, [local[i] for i in greedy])) if greedy else None
        if self.lookahead is not None:
            self._go_ahead(planned, done, taken, ahead, greedy, chosen)
        tokens: dict[int, int] = {}
        if ahead is not None:
            got = ahead.chosen.tokens()
            tokens.update((i, got[k]) for i, k in taken.items())
        if chosen is not None:
            tokens.update(zip(greedy, chosen.tokens(), strict=True))
        for i in done:
            if i not in tokens:
                assert logits is not None
                tokens[i] = planned[i][0].sampler(logits[local[i]])
        for (seq, row) in planned:
            seq.computed = row.end
            seq.kv.ticket = None  # the step's stream has waited for every layer's copy
        for i in done:
            seq = planned[i][0]
            try:
                self._accept(seq, tokens[i])
            except Exception as exc:
                result.failed.append((seq, exc))
        if len(planned) == 1 and done and not taken:
            self._observe(planned[0][0], time.perf_counter() - started)

    def _forward(self, planned: list[tuple[Sequence, paged.BatchRow]]) -> torch.Tensor:
        """``[rows, vocab]`` logits of one forward over ``planned`` (queued on the device)."""
        rows = [row for _, row in planned]
        logits = self._suffix(planned)
        if logits is None and self.decode_graphs is not None:
            logits = self.decode_graphs.run(rows, self.pages.kv)
        if logits is None:
            logits = paged.forward_batch(self.lm, rows, self.pages.kv)
        return logits

    def _go_ahead(self, planned: list[tuple[Sequence, paged.BatchRow]], done: list[int],
                  taken: dict[int, int], ahead: Any, greedy: list[int],
                  chosen: Chosen | None) -> None:
        """Queue the next step now, fed this step's tokens on the device (``ahead``), if every
        row of this step reached its end and those that go on are greedy and committed."""
        assert self.lookahead is not None
        if len(done) != len(planned):
            return                        # a prefill chunk goes on next step
        going: list[int] = []
        for i, (seq, _) in enumerate(planned):
            request = seq.request
            if (seq.handle.cancelled or seq.generated + 1 >= request.max_new_tokens
                    or len(seq.tokens) + 1 >= self.lm.max_positions):
                continue                  # ends with this step's token
            if not seq.sampler.params.greedy or not seq.committed:
                return
            going.append(i)
        if not going:
            return
        if all(i in taken for i in going):
            fed, index = ahead.chosen, [taken[i] for i in going]
        elif chosen is not None and all(i not in taken for i in going):
            position = {i: j for j, i in enumerate(greedy)}
            fed, index = chosen, [position[i] for i in going]
        else:
            return
        rows = []
        try:
            for i in going:
                seq, row = planned[i]
                self.pages.grow(seq.kv, row.end + 1)
                rows.append((seq, paged.BatchRow(seq.kv.table, row.end, (0,))))
        except PoolExhausted:
            return                        # the next step preempts as usual
        self.lookahead.launch(rows, self.pages.kv, fed, index)

    def _suffix(self, planned: list[tuple[Sequence, paged.BatchRow]]) -> torch.Tensor | None:
        """A lone fresh hit's suffix through the captured graphs (``suffix_step``), or None."""
        if self.suffix is None or len(planned) != 1:
            return None
        seq, row = planned[0]
        if not self.suffix.eligible(row, len(seq.tokens), not seq.committed, self.pages.page_size):
            return None
        return self.suffix.run(row, self.pages.kv)

    def _accept(self, seq: Sequence, token: int) -> None:
        seq.tokens.append(token)
        seq.generated += 1
        seq.handle._emit(TokenEvent(token))
        if not seq.committed:   # the first token is out: the prompt's pages go to the cache
            seq.committed = True
            seq.report.prefill_s = time.perf_counter() - seq.admitted_at
            seq.report.computed_tokens = seq.report.prompt_tokens - seq.report.cached_tokens
            self.pages.commit_prompt(seq.kv, seq.tokens[:seq.computed])
            self._apply_hint(seq)

    def _apply_hint(self, seq: Sequence) -> None:
        """A request's cache hint (soft priority) on the prompt's pages, once they are committed."""
        request = seq.request
        if request.hint is None or self.prefix_cache is None:
            return
        prompt = seq.tokens[:seq.report.prompt_tokens]
        outcome = self.prefix_cache.tiered.hint(prompt, request.hint, request.salt, request.tenant)
        seq.report.cache_hint = {**request.hint.as_dict(), **outcome.as_dict()}

    def _observe(self, seq: Sequence, seconds: float) -> None:
        """A cold prompt run whole and alone teaches the split the prefill rate."""
        report = seq.report
        if (self.prefix_cache is not None and seq.generated == 1 and report.matched_tokens == 0
                and report.prompt_tokens >= MIN_OBSERVED_PREFILL_TOKENS
                and report.prompt_tokens <= self.chunk_tokens):
            self.prefix_cache.tiered.observe_prefill(report.prompt_tokens, seconds)

    # ---- leaving ---------------------------------------------------------------------------
    def preempt(self, seq: Sequence) -> None:
        """Give back every page of ``seq`` (its computed full pages committed first); it keeps
        its tokens and comes back through ``admit``."""
        self._settle()
        pages, seq.kv = seq.kv, None
        self.pages.close(pages, seq.tokens[:seq.computed], commit=True)
        seq.computed = 0
        self.counters["preempted"] += 1

    def finished_reason(self, seq: Sequence) -> str | None:
        """'stop' after an EOS token, 'length' at the token cap, 'cancelled', else None."""
        if seq.handle.cancelled:
            return "cancelled"
        if seq.generated and seq.tokens[-1] in seq.request.stop_token_ids:
            return "stop"
        if seq.generated >= seq.request.max_new_tokens:
            return "length"
        if len(seq.tokens) >= self.lm.max_positions:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str, error: Exception | None = None) -> None:
        """Commit the KV this sequence computed, release its pins, tell the submitter."""
        try:
            if seq.kv is not None:
                self._settle()
                self.pages.close(seq.kv, seq.tokens[:seq.computed], commit=error is None)
        finally:
            seq.kv = None
            seq.handle._emit(FinishEvent(reason, seq.generated, seq.report,
                                         None if error is None else str(error),
                                         None if error is None else type(error).__name__))

    def _settle(self) -> None:
        """Before a sequence's pages go back: the step queued ahead may still write into them."""
        if self.lookahead is not None:
            self.lookahead.settle()

    def release(self) -> None:
        """After the engine thread stopped: drop the captured graphs (and their memory pools)
        and give the device page pool back; the engine cannot step again."""
        self._settle()
        self.decode_graphs = self.suffix = self.lookahead = None
        self.pages.device_pool.release()

    def stats(self) -> dict[str, Any]:
        served = ({"suffix_graph_steps": self.suffix.served, "suffix_graphs": self.suffix.stats()}
                  if self.suffix is not None else {})
        if self.decode_graphs is not None:
            served["decode_graphs"] = self.decode_graphs.stats()
        if self.lookahead is not None:
            served.update(self.lookahead.counters)
        return {**self.counters, **served}
