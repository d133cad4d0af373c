"""The OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

Owns ``build_router(service, config)``: request checks (model name, unsupported fields, prompt
length against ``server.max_prompt_tokens`` and the model's positions), the mapping of a request
onto a ``GenerationRequest``, and both answer shapes (one JSON body, or server-sent events
ending in ``data: [DONE]``, with a final usage chunk when ``stream_options.include_usage``).
Usage carries ``prompt_tokens_details.cached_tokens`` and kvtier's per-tier breakdown under
``usage.kvtier``. The model answers to ``server.served_model_name`` (comma-separated names; the
model's own name when empty). ``/v1/models`` lists those names with ``max_model_len`` (prompt
plus generated tokens: the model's positions or ``server.max_model_len``) and, as ``created``,
when this server loaded it. A client that leaves before its answer is whole ends its
generation, is counted (``LimitCounters.disconnects["response"]``) and logged on one line;
nothing is sent. Runs on the server's event loop. (No ``from __future__ import annotations``:
FastAPI reads the route annotations, and ``Request`` is imported lazily inside ``build_router``.)
"""

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvtier.config import KvtierConfig
from kvtier.engine.request import GenerationRequest
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.text import chat_prompt_ids, encode_prompt
from kvtier.hints import HintError
from kvtier.serve.errors import APIError
from kvtier.serve.generation import ClientGone, Done, stream_text
from kvtier.serve.schemas import ChatCompletionRequest, CompletionRequest
from kvtier.serve.sizing import model_len
from kvtier.serve.streams import EventStream, NoAnswer, client_gone

log = logging.getLogger("kvtier.http")


def served_names(config: KvtierConfig, model: str) -> list[str]:
    """The names the model answers to: ``server.served_model_name``'s, else its own."""
    names = [n.strip() for n in config.server.served_model_name.split(",") if n.strip()]
    return names or [model]


def sse(data: dict[str, Any] | str) -> str:
    body = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {body}\n\n"


class OpenAIRoutes:
    """Request handling shared by the completion and chat routes."""

    def __init__(self, service: Any, config: KvtierConfig) -> None:
        self.service = service
        self.config = config
        self.names = served_names(config, service.model_name)
        self.name = self.names[0]

    @property
    def max_len(self) -> int:
        """Positions a request may use (read per request: building the routes needs no model)."""
        return model_len(self.config, self.service.lm)

    def check(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        if body.model not in self.names:
            raise APIError(404, f"model {body.model!r} is not served here; this server serves "
                           f"{' or '.join(map(repr, self.names))} (see /v1/models)",
                           param="model", code="model_not_found")
        problem = body.unsupported()
        if problem:
            raise APIError(400, problem, param=problem.split(":", 1)[0],
                           code="unsupported_parameter")

    def generation(self, body: Any, prompt_ids: list[int], cap: int | None,
                   request_id: str) -> GenerationRequest:
        limit = self.config.server.max_prompt_tokens
        room = self.max_len - len(prompt_ids)
        if len(prompt_ids) > limit or room < 1:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; this server accepts "
                           f"at most {min(limit, self.max_len - 1)}",
                           param="prompt", code="context_length_exceeded")
        if cap is not None and cap > room:
            raise APIError(400, f"max_tokens {cap} plus the prompt's {len(prompt_ids)} tokens "
                           f"exceed the {self.max_len} positions of a request (max_model_len)",
                           param="max_tokens", code="context_length_exceeded")
        vocab = self.service.lm.config.vocab_size
        if any(t >= vocab for t in prompt_ids):
            raise APIError(400, f"token ids must be below the vocabulary size {vocab}",
                           param="prompt")
        max_new = cap if cap is not None else min(self.config.engine.max_new_tokens, room)
        stops = () if body.ignore_eos else self.service.lm.eos_token_ids
        try:
            hint = body.cache_hint()
        except HintError as exc:
            raise APIError(400, str(exc), param=exc.field) from None
        return GenerationRequest(
            tuple(prompt_ids), max_new, SamplingParams(body.temperature, body.top_p, body.seed),
            stops, body.cache_salt, body.tenant, request_id, hint=hint)

    async def answer(self, body: Any, request: GenerationRequest, http: Any,
                     shape: Callable[[str, str | None], dict[str, Any]], first: dict[str, Any] | None,
                     envelope: Callable[[str, dict[str, Any]], dict[str, Any]]) -> Any:
        from fastapi.responses import JSONResponse

        pieces = stream_text(self.service, request, body.stop,
                             client_gone=client_gone(http.receive))
        try:
            if body.stream:
                first_item = await anext(pieces)  # errors (429) surface before the stream starts
                return EventStream(self._events(body, first_item, pieces, shape, first, http))
            text, done = [], None
            async for item in pieces:
                if isinstance(item, Done):
                    done = item
                else:
                    text.append(item)
        except ClientGone as gone:
            _count_gone(http, gone)
            return NoAnswer()
        assert done is not None
        return JSONResponse(envelope("".join(text), {"finish_reason": done.finish_reason,
                                                     "usage": done.usage}))

    async def _events(self, body: Any, first_item: Any, pieces: AsyncIterator[Any],
                      shape: Callable[[str, str | None], dict[str, Any]],
                      first: dict[str, Any] | None, http: Any) -> AsyncIterator[str]:
        if first is not None:
            yield sse(first)
        try:
            item = first_item
            while True:
                if isinstance(item, Done):
                    yield sse(shape("", item.finish_reason))
                    if body.include_usage:
                        yield sse({**shape("", None), "choices": [], "usage": item.usage})
                    break
                yield sse(shape(item, None))
                item = await anext(pieces)
        except APIError as exc:
            yield sse(exc.body())
        except ClientGone as gone:
            _count_gone(http, gone)
            return
        finally:
            await pieces.aclose()
        yield sse("[DONE]")


def _count_gone(http: Any, gone: ClientGone) -> None:
    counters = getattr(http.app.state, "limits", None)
    if counters is not None:
        counters.disconnected("response")
    log.info("%s (%s %s)", gone, http.method, http.url.path)


def _ids(prefix: str) -> tuple[str, int]:
    return f"{prefix}-{uuid.uuid4().hex[:24]}", int(time.time())


def build_router(service: Any, config: KvtierConfig) -> Any:
    from fastapi import APIRouter, Request

    routes = OpenAIRoutes(service, config)
    router = APIRouter()
    loaded_at = int(time.time())  # the router is built once the model has loaded

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": loaded_at,
                                            "owned_by": "kvtier", "max_model_len": routes.max_len}
                                           for name in routes.names]}

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request) -> Any:
        routes.check(body)
        try:
            prompt = body.single_prompt()
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt") from None
        ids = prompt if isinstance(prompt, list) else encode_prompt(service.tokenizer, prompt)
        rid, created = _ids("cmpl")
        gen = routes.generation(body, list(ids), body.max_tokens, rid)

        def chunk(text: str, reason: str | None) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": created,
                    "model": routes.name,
                    "choices": [{"index": 0, "text": text, "logprobs": None,
                                 "finish_reason": reason}]}

        def whole(text: str, end: dict[str, Any]) -> dict[str, Any]:
            return {**chunk(text, end["finish_reason"]), "usage": end["usage"]}

        return await routes.answer(body, gen, http, chunk, None, whole)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Any:
        routes.check(body)
        try:
            ids = chat_prompt_ids(service.tokenizer, body.chat())
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
        rid, created = _ids("chatcmpl")
        gen = routes.generation(body, ids, body.token_cap, rid)

        def chunk(text: str, reason: str | None) -> dict[str, Any]:
            delta = {"content": text} if text or reason is None else {}
            return {"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": routes.name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                 "finish_reason": reason}]}

        first = chunk("", None)
        first["choices"][0]["delta"] = {"role": "assistant", "content": ""}

        def whole(text: str, end: dict[str, Any]) -> dict[str, Any]:
            return {"id": rid, "object": "chat.completion", "created": created,
                    "model": routes.name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "logprobs": None, "finish_reason": end["finish_reason"]}],
                    "usage": end["usage"]}

        return await routes.answer(body, gen, http, chunk, first, whole)

    return router
