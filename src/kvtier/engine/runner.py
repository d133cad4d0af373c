"""The generation loop for one request at a time: prefill (through the tiered cache), decode, finish.

Owns ``Engine`` and ``Sequence``. ``Engine.prefill`` turns a request into a running sequence
whose first token is already chosen and sent (``PrefixCache`` in ``kvtier.engine.prefix``
decides what comes from the cache and what is recomputed, and commits the prompt's pages once
the first token is out); ``Engine.decode`` adds one token;
``Engine.finish`` commits the sequence's KV pages to the cache and releases what it pinned.
The scheduler interleaves many sequences over these three calls. Engine thread only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.engine.hf import CausalLM
from kvtier.engine.request import FinishEvent, PrefillReport, RequestHandle, TokenEvent
from kvtier.engine.sampling import Sampler


@dataclass
class Sequence:
    """A request being generated: its tokens, its model cache and what it pinned."""

    handle: RequestHandle
    kv: Any                        # the model's DynamicCache (past of every fed token)
    sampler: Sampler
    tokens: list[int]              # prompt, then generated tokens
    report: PrefillReport
    prefix_state: Any = None       # what PrefixCache keeps between prefill and finish
    generated: int = 0
    started_at: float = field(default_factory=time.perf_counter)

    @property
    def request(self) -> Any:
        return self.handle.request


class Engine:
    """Runs prefill and decode steps on one ``CausalLM`` with an optional ``PrefixCache``."""

    def __init__(self, lm: CausalLM, prefix_cache: Any = None) -> None:
        self.lm = lm
        self.prefix_cache = prefix_cache

    def prefill(self, handle: RequestHandle) -> Sequence:
        """Serve the prompt and emit its first token; the caller owns the returned sequence."""
        request = handle.request
        started = time.perf_counter()
        prompt = list(request.prompt_ids)
        report = PrefillReport(prompt_tokens=len(prompt), queue_s=started - handle.submitted_at)
        if self.prefix_cache is None:
            kv = self.lm.new_cache()
            logits = self.lm.forward(self._tensor(prompt), kv)
            report.computed_tokens = len(prompt)
            seq = Sequence(handle, kv, Sampler(request.sampling), list(prompt), report)
            self._accept(seq, seq.sampler(logits))
            report.prefill_s = time.perf_counter() - started
            return seq
        kv, logits, state = self.prefix_cache.prefill(prompt, request.salt, report)
        try:
            seq = Sequence(handle, kv, Sampler(request.sampling), list(prompt), report, state)
            self._accept(seq, seq.sampler(logits))  # the first token goes out before the commit
            report.prefill_s = time.perf_counter() - started
        finally:
            self.prefix_cache.commit_prompt(state, prompt, kv)
        if request.hint is not None:
            outcome = self.prefix_cache.tiered.hint(prompt, request.hint, request.salt,
                                                    request.tenant)
            report.cache_hint = {**request.hint.as_dict(), **outcome.as_dict()}
        return seq

    def decode(self, seq: Sequence) -> None:
        """Feed the last chosen token and choose the next one."""
        logits = self.lm.forward(self._tensor(seq.tokens[-1:]), seq.kv)
        self._accept(seq, seq.sampler(logits))

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
            if self.prefix_cache is not None and seq.prefix_state is not None:
                self.prefix_cache.finish(seq.prefix_state, seq.tokens[:-1], seq.kv,
                                         commit=error is None)
        finally:
            seq.kv = None
            seq.handle._emit(FinishEvent(reason, seq.generated, seq.report,
                                         None if error is None else str(error),
                                         None if error is None else type(error).__name__))

    def _accept(self, seq: Sequence, token: int) -> None:
        seq.tokens.append(token)
        seq.generated += 1
        seq.handle._emit(TokenEvent(token))

    def _tensor(self, tokens: list[int]) -> torch.Tensor:
        return torch.tensor(tokens, dtype=torch.long, device=self.lm.device)
