"""Request bodies of the OpenAI-compatible routes (pydantic), and the checks beyond their schema.

Owns ``CompletionRequest`` and ``ChatCompletionRequest``: the OpenAI fields kvtier serves, the
``cache_salt`` extension (isolates a tenant's cached prefixes), and ``unsupported()`` which
names a field set to something the reference engine cannot do (n > 1, logprobs, tools, ...),
so the client gets a clear 400 rather than a silently different answer. A field no model here
declares is refused (400 ``unknown_parameter`` naming it, as OpenAI's API answers): these
classes are the one place that says which fields a request may carry, extensions included
(``cache_salt``, ``ignore_eos``). Text that is not valid Unicode (a lone UTF-16 surrogate such
as ``"\\ud800"``, which JSON can escape but no tokenizer can encode) and a ``seed`` the sampler
cannot take are refused as 400 ``invalid_value`` naming the field. Request threads (asyncio); no
engine imports.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvtier.hints import CacheHint, cache_control_hint, openai_hint, strongest

MAX_STOPS = 4
#: The seeds a sampler's generator takes: any 64-bit integer, signed or unsigned.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(value: Any, where: str = "") -> tuple[str, int] | None:
    """(field path, character index) of the first lone surrogate in ``value``'s strings (nested
    lists and dicts, keys included), or None."""
    if isinstance(value, str):
        match = _SURROGATE.search(value)
        return (where or "body", match.start()) if match else None
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{where}.{key}" if where else str(key)
            found = lone_surrogate(key, where or "body") or lone_surrogate(item, path)
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = lone_surrogate(item, f"{where}[{i}]")
            if found:
                return found
    return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: list[str] = Field(default_factory=list)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256,
                                   description="kvtier extension: tenant salt for cached prefixes")
    ignore_eos: bool = False
    prompt_cache_key: Any = Field(None, description="OpenAI: prefix-cache affinity key")
    prompt_cache_retention: Any = Field(None, description="OpenAI: 'in_memory' or '24h'")
    cache_control: Any = Field(None, description="Anthropic-style {'type': 'ephemeral', "
                               "'ttl': '5m' | '1h'} for the whole prompt")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        found = lone_surrogate(data)
        if found:
            raise PydanticCustomError(
                "invalid_unicode", "the text holds a lone UTF-16 surrogate at character {at}, "
                "which is not valid Unicode (send UTF-8 text; escape a character beyond U+FFFF "
                "as a surrogate pair such as \\ud83d\\ude00)",
                {"field": found[0], "at": found[1]})
        return data

    def cache_hint(self) -> CacheHint | None:
        """The request's cache hint (kvtier.hints); HintError names a bad field."""
        return strongest([openai_hint(self.prompt_cache_key, self.prompt_cache_retention),
                          cache_control_hint(self.cache_control), *self._part_hints()])

    def _part_hints(self) -> list[CacheHint | None]:
        return []

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, value: Any) -> list[str]:
        if value is not None and not isinstance(value, (str, list)):
            raise ValueError("stop must be a string or a list of strings")
        stops = [value] if isinstance(value, str) else list(value or [])
        if not all(isinstance(s, str) for s in stops):
            raise ValueError("stop must be a string or a list of strings")
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        return [s for s in stops if s]

    def unsupported(self) -> str | None:
        """A message naming a field this server cannot honour, or None."""
        checks = [
            (self.n != 1, "n", "only n=1 is supported"),
            (bool(self.logprobs), "logprobs", "logprobs are not supported"),
            (self.presence_penalty != 0.0, "presence_penalty", "penalties are not supported"),
            (self.frequency_penalty != 0.0, "frequency_penalty", "penalties are not supported"),
            (bool(self.logit_bias), "logit_bias", "logit_bias is not supported"),
        ]
        return next((f"{field}: {why}" for bad, field, why in checks if bad), None)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def tenant(self) -> str:
        """Fairness key: the cache salt, else the user, else one shared queue."""
        return self.cache_salt or self.user or ""


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo: echoing the prompt is not supported"
        if self.suffix:
            return "suffix: insertion is not supported"
        if self.best_of not in (None, 1):
            return "best_of: only best_of=1 is supported"
        return super().unsupported()

    def single_prompt(self) -> str | list[int]:
        """The one prompt, as text or token ids; ValueError for a batch."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("send one prompt per request (got a batch of "
                                 f"{len(prompt)})")
            prompt = prompt[0]
        if isinstance(prompt, list) and any(not isinstance(t, int) or t < 0 for t in prompt):
            raise ValueError("token id prompts must be non-negative integers")
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt  # type: ignore[return-value]


class ContentPart(BaseModel):
    """One part of a message's content; other kinds (images, audio) carry their own fields,
    so extras are kept here and refused by ``ChatMessage.text`` with the part's kind."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    cache_control: Any = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    cache_control: Any = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"message content of type {part.type!r} is not supported "
                                 "(text only)")
            if part.model_extra:
                raise ValueError("unrecognized field in a text content part: "
                                 + ", ".join(sorted(part.model_extra)))
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools: tool calling is not supported"
        if self.tool_choice not in (None, "none"):
            return "tool_choice: tool calling is not supported"
        if self.top_logprobs:
            return "top_logprobs: logprobs are not supported"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format: only text output is supported"
        return super().unsupported()

    def _part_hints(self) -> list[CacheHint | None]:
        """Anthropic-style ``cache_control`` on a message or on one of its content parts."""
        out = []
        for i, message in enumerate(self.messages):
            out.append(cache_control_hint(message.cache_control, f"messages[{i}].cache_control"))
            for j, part in enumerate(message.content if isinstance(message.content, list) else []):
                out.append(cache_control_hint(part.cache_control,
                                              f"messages[{i}].content[{j}].cache_control"))
        return out

    @property
    def token_cap(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def chat(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]
