"""Requests to the engine and what comes back: ``GenerationRequest``, events and ``RequestHandle``.

Owns the plain data that crosses from request threads (the HTTP server, a benchmark) to the
engine thread and back. A ``RequestHandle`` is filled by the engine thread and read by the
submitter: through a blocking iterator (benchmarks, tests) or a callback the asyncio server
installs. Thread-safe where stated; no torch.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvtier.engine.request_stats import TOKEN_GAP_BOUNDS_S, LatencyHistogram
from kvtier.engine.sampling import SamplingParams

TIERS = ("device", "host", "disk", "remote")
_ids = itertools.count(1)


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to continue. ``salt`` isolates a tenant's cache; ``tenant`` is the fairness key."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    salt: str | None = None
    tenant: str = ""
    request_id: str = ""
    hint: Any = None               # kvtier.hints.CacheHint: keep the prefix longer (soft)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt is empty")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.request_id:
            object.__setattr__(self, "request_id", f"req-{next(_ids)}")


@dataclass
class PrefillReport:
    """How a prompt's prefill was served; ``cached_tokens`` is what the cache supplied."""

    prompt_tokens: int
    cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    matched_tokens: int = 0
    recomputed_hit_tokens: int = 0
    computed_tokens: int = 0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    cache_hint: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        out = {"cached_tokens": self.cached_tokens, "cached_tokens_by_tier": dict(self.cached_by_tier),
               "matched_tokens": self.matched_tokens,
               "recomputed_hit_tokens": self.recomputed_hit_tokens,
               "computed_tokens": self.computed_tokens, "queue_s": round(self.queue_s, 6),
               "prefill_s": round(self.prefill_s, 6)}
        if self.cache_hint is not None:
            out["cache_hint"] = self.cache_hint
        return out


@dataclass(frozen=True)
class TokenEvent:
    token_id: int


@dataclass(frozen=True)
class FinishEvent:
    """The request ended: ``reason`` is 'stop' (EOS), 'length', 'cancelled' or 'error'."""

    reason: str
    completion_tokens: int
    prefill: PrefillReport | None
    error: str | None = None
    error_kind: str | None = None


Event = TokenEvent | FinishEvent


class RequestHandle:
    """The submitter's side of one request. The engine thread calls ``_emit``; the submitter
    iterates ``events()`` or installs ``set_sink`` before submitting; ``cancel()`` from anywhere."""

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.token_gaps = LatencyHistogram(TOKEN_GAP_BOUNDS_S)  # engine thread only
        self._queue: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._sink: Callable[[Event], None] | None = None
        self._cancelled = threading.Event()
        self.done = threading.Event()

    def set_sink(self, sink: Callable[[Event], None]) -> None:
        """Deliver events to ``sink`` (called on the engine thread) instead of the queue."""
        self._sink = sink

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _emit(self, event: Event) -> None:
        if isinstance(event, TokenEvent):
            now = time.perf_counter()
            if self.first_token_at is None:
                self.first_token_at = now
            else:
                self.token_gaps.observe(now - (self.last_token_at or now))
            self.last_token_at = now
        if self._sink is not None:
            self._sink(event)
        else:
            self._queue.put(event)
        if isinstance(event, FinishEvent):
            self.done.set()

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Events until (and including) the ``FinishEvent``; raises ``TimeoutError`` past
        ``timeout`` seconds of silence."""
        while True:
            try:
                event = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no event from the engine within {timeout} s") from None
            yield event
            if isinstance(event, FinishEvent):
                return

    def result(self, timeout: float | None = None) -> tuple[list[int], FinishEvent]:
        """Block until the end: (generated token ids, finish event)."""
        tokens: list[int] = []
        for event in self.events(timeout):
            if isinstance(event, TokenEvent):
                tokens.append(event.token_id)
            else:
                return tokens, event
        raise RuntimeError("the event stream ended without a finish event")
