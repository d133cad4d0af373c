"""One generation seen from asyncio: submit to the engine thread, stream text, end with usage.

Owns ``stream_text``: it submits a ``GenerationRequest`` with a sink that hands engine events to
the event loop, turns each token id into a text increment (``Detokenizer``; possibly empty),
cuts at stop strings (``StopMatcher``), cancels the engine's work when the stream ends early
(stop string, client gone), finishes with a ``Done`` carrying the finish reason and the OpenAI
usage block, and logs one line per request when it ends, whatever ended it
(``serve.logs.request_line``). A client that leaves is seen at once: a task awaits
``client_gone`` and puts a marker in the event queue, and ``stream_text`` raises ``ClientGone``
(an ordinary exception, so no generator is cancelled from another task).
Runs on the server's event loop; the engine runs on its own thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvtier.engine.request import FinishEvent, GenerationRequest, PrefillReport, TokenEvent
from kvtier.engine.scheduler import QueueFull, ShuttingDown
from kvtier.engine.text import Detokenizer, StopMatcher
from kvtier.serve.errors import APIError
from kvtier.serve.logs import request_line, request_log

_GONE = object()  # queued by the watcher of ``client_gone``


class ClientGone(Exception):
    """The client disconnected before its answer was whole; the engine's work was cancelled."""


@dataclass(frozen=True)
class Done:
    finish_reason: str
    usage: dict[str, Any]


def usage_block(report: PrefillReport | None, prompt_tokens: int,
                completion_tokens: int) -> dict[str, Any]:
    """OpenAI usage, with ``cached_tokens`` and kvtier's per-tier breakdown."""
    cached = report.cached_tokens if report else 0
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if report is not None:
        usage["kvtier"] = report.as_dict()
    return usage


def _sink(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Any]) -> Callable[[Any], None]:
    def deliver(event: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, event)
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass
    return deliver


def _watch(queue: asyncio.Queue[Any],
           client_gone: Callable[[], Awaitable[Any]] | None) -> asyncio.Task[None] | None:
    if client_gone is None:
        return None

    async def watch() -> None:
        await client_gone()
        queue.put_nowait(_GONE)

    return asyncio.get_running_loop().create_task(watch())


async def stream_text(service: Any, request: GenerationRequest, stops: list[str], *,
                      client_gone: Callable[[], Awaitable[Any]] | None = None
                      ) -> AsyncIterator[str | Done]:
    """Yield text increments, then one ``Done``. Raises ``APIError`` 429 when the queue is full,
    503 when the server stops before the request finished and 500 when the engine fails it;
    ``ClientGone`` once ``client_gone()`` returned (the client left)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()
    try:
        handle = service.submit(request, sink=_sink(loop, queue))
    except QueueFull as exc:
        raise APIError(429, str(exc), code="queue_full") from None
    detok = Detokenizer(service.tokenizer)
    stopper = StopMatcher(stops)
    produced, reason, outcome, report = 0, None, "cancelled", None
    watcher = _watch(queue, client_gone)
    try:
        while True:
            event = await queue.get()
            if event is _GONE:
                raise ClientGone(f"{request.request_id}: the client left after {produced} "
                                 "generated tokens")
            if isinstance(event, TokenEvent):
                if reason is not None:
                    continue  # generated after a stop string; not part of the answer
                produced += 1
                if event.token_id not in request.stop_token_ids:
                    # One increment per token, empty while the text is incomplete (a partial
                    # UTF-8 character, a possible stop string held back): a stream's chunks
                    # then time its tokens, as vLLM's do.
                    yield stopper.feed(detok.push(event.token_id))
                if stopper.stopped:
                    reason = "stop"
                    handle.cancel()
                continue
            assert isinstance(event, FinishEvent)
            report = event.prefill
            if event.reason == "error":
                outcome = "error"
                status = 503 if event.error_kind == ShuttingDown.__name__ else 500
                raise APIError(status, f"generation failed: {event.error}",
                               code=event.error_kind)
            if reason is None:
                tail = stopper.feed(detok.flush()) + stopper.flush()
                if tail:
                    yield tail
                stopped = stopper.stopped or event.reason in ("stop", "cancelled")
                reason = "stop" if stopped else event.reason
            outcome = reason
            yield Done(reason, usage_block(event.prefill, len(request.prompt_ids), produced))
            return
    finally:
        if watcher is not None:
            watcher.cancel()
        if not handle.done.is_set():
            handle.cancel()
        _log_end(request, handle, outcome, report, produced)


def _log_end(request: GenerationRequest, handle: Any, outcome: str, report: PrefillReport | None,
             produced: int) -> None:
    first = handle.first_token_at
    request_log.info(request_line(
        request.request_id, outcome, len(request.prompt_ids), report, produced,
        None if first is None else first - handle.submitted_at,
        time.perf_counter() - handle.submitted_at))
