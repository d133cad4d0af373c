"""Text around the engine: prompt encoding, chat formatting, streaming detokenization, stop strings.

Owns ``encode_prompt``, ``chat_prompt_ids``, ``Detokenizer`` (token ids in, new text out, never
splitting a multi-byte character) and ``StopMatcher`` (holds back text that may be the start of
a stop string). Pure Python over a transformers tokenizer; used on request threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a completion prompt, with the tokenizer's own special tokens (BOS)."""
    return list(tokenizer(text)["input_ids"])


def chat_prompt_ids(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of a chat, formatted by the tokenizer's chat template (a plain 'role: text'
    layout when it has none), ending where the assistant's answer starts."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                             tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return encode_prompt(tokenizer, text)


class Detokenizer:
    """Turns a stream of token ids into text increments.

    Decodes a short window of recent tokens twice (with and without the newest ones) and emits
    the difference, so tokenizers whose pieces depend on their neighbours (leading-space
    markers) still give the same text as decoding everything at once. An increment that ends in
    a partial UTF-8 character waits for the next token.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0     # start of the decode window
        self._read = 0       # tokens already turned into emitted text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]

    def flush(self) -> str:
        """Text still held back at the end of the stream (a dangling partial character)."""
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return after[len(before):]


class StopMatcher:
    """Cuts generated text at the first stop string, holding back a possible stop prefix."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text safe to emit now; sets ``stopped`` once a stop string has appeared and no stop
        starting earlier can still complete."""
        if self.stopped:
            return ""
        buffer = self._pending + text
        first = self._first_hit(buffer)
        hold = self._held_suffix(buffer)
        undecided = len(buffer) - hold if hold else None  # where a stop may still begin
        if first is not None and (undecided is None or undecided >= first):
            self.stopped = True
            self._pending = ""
            return buffer[:first]
        keep_from = len(buffer) if undecided is None else undecided
        self._pending = buffer[keep_from:]
        return buffer[:keep_from]

    def flush(self) -> str:
        """The held-back text at the end of the stream, cut at a stop string it holds."""
        buffer, self._pending = ("" if self.stopped else self._pending), ""
        first = self._first_hit(buffer)
        if first is not None:
            self.stopped = True
            return buffer[:first]
        return buffer

    def _first_hit(self, buffer: str) -> int | None:
        hits = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _held_suffix(self, buffer: str) -> int:
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest
