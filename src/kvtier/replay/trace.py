"""Request traces: reading, writing and summarising block-level prefix traces.

Owns ``TraceRequest`` and ``Trace`` and the JSON-lines format they are read from and written to
(the Mooncake trace format): one object per line with ``timestamp`` (ms), ``input_length`` and
``output_length`` (tokens) and ``hash_ids`` (one id per ``block_tokens`` block of the input; equal
ids mean equal content, and an id depends on everything before it, so the ids of a request form
a prefix chain). Optional per-request cache hints use the API's own fields
(``prompt_cache_key``, ``prompt_cache_retention``, ``cache_control``; see ``kvtier.hints``),
with an optional ``tenant`` string. Requests come back in timestamp order (stable for equal timestamps). Pure
Python; the main thread of ``kvtier bench replay`` runs it.
"""

from __future__ import annotations

import json
import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.hints import (
    ANTHROPIC_TTL,
    OPENAI_RETENTION,
    CacheHint,
    HintError,
    cache_control_hint,
    openai_hint,
    strongest,
)

#: Tokens per block of the published Mooncake traces.
DEFAULT_BLOCK_TOKENS = 512
#: Odd, so that ``id * SPREAD_MULTIPLIER mod 2**32`` is a bijection (distinct ids stay
#: distinct); ``2**32 / golden ratio``, whose high bits scatter consecutive ids.
SPREAD_MULTIPLIER = 0x9E3779B1


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: when it came, how long it was, which blocks it is made of."""

    timestamp_ms: int
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]
    hint: CacheHint | None = None
    tenant: str = ""

    def block_bytes(self, spread: bool = False) -> bytes:
        """The block ids as uint32 little-endian bytes: one index page per block. ``spread``
        maps each id through a bijective multiplicative hash (Knuth's 2^32 / golden ratio) and
        stores it high byte first, so a page's leading bytes look like a live page key's (a
        content hash) and a sample taken by them is spread over the whole trace; the raw ids,
        numbered in order of first appearance, put their leading bytes' sample in windows of
        time."""
        if not spread:
            return array("I", self.blocks).tobytes()
        mixed = array("I", [(block * SPREAD_MULTIPLIER) & 0xFFFFFFFF for block in self.blocks])
        if sys.byteorder == "little":
            mixed.byteswap()
        return mixed.tobytes()

    def served_tokens(self, blocks_hit: int, block_tokens: int) -> int:
        """Input tokens served by a cached prefix of ``blocks_hit`` blocks (the last block of
        a request may be partial, so the share is capped at the input length)."""
        return min(blocks_hit * block_tokens, self.input_tokens)

    def to_json(self) -> str:
        obj: dict[str, object] = {"timestamp": self.timestamp_ms,
                                  "input_length": self.input_tokens,
                                  "output_length": self.output_tokens,
                                  "hash_ids": list(self.blocks)}
        if self.hint is not None:
            obj |= _hint_fields(self.hint)
        if self.tenant:
            obj["tenant"] = self.tenant
        return json.dumps(obj)


def _hint_fields(hint: CacheHint) -> dict[str, object]:
    """The API fields that parse back to ``hint``."""
    if hint.source == "cache_control":
        ttl = next(k for k, v in ANTHROPIC_TTL.items() if v == hint.retention_s)
        return {"cache_control": {"type": "ephemeral", "ttl": ttl}}
    out: dict[str, object] = {"prompt_cache_retention": next(
        k for k, v in OPENAI_RETENTION.items() if v == hint.retention_s)}
    if hint.key:
        out["prompt_cache_key"] = hint.key
    return out


@dataclass(frozen=True)
class Trace:
    """Requests in timestamp order, and the block size their ids were cut at."""

    requests: tuple[TraceRequest, ...]
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    name: str = "trace"

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    @property
    def input_tokens(self) -> int:
        return sum(r.input_tokens for r in self.requests)

    @property
    def block_accesses(self) -> int:
        return sum(len(r.blocks) for r in self.requests)

    def unique_blocks(self) -> int:
        seen: set[int] = set()
        for r in self.requests:
            seen.update(r.blocks)
        return len(seen)

    def duration_s(self) -> float:
        if not self.requests:
            return 0.0
        return (self.requests[-1].timestamp_ms - self.requests[0].timestamp_ms) / 1000.0

    def part(self, index: int, parts: int) -> Trace:
        """Part ``index`` of ``parts`` consecutive, equal-count slices (held-out checks)."""
        if not 0 <= index < parts:
            raise ValueError(f"part {index} of {parts}")
        n = len(self.requests)
        lo, hi = n * index // parts, n * (index + 1) // parts
        return Trace(self.requests[lo:hi], self.block_tokens, f"{self.name}[{index + 1}/{parts}]")

    def infinite_share(self) -> float:
        """Share of input tokens a prefix cache of unlimited capacity serves."""
        seen: set[int] = set()
        served = 0
        for r in self.requests:
            hit = 0
            while hit < len(r.blocks) and r.blocks[hit] in seen:
                hit += 1
            served += r.served_tokens(hit, self.block_tokens)
            seen.update(r.blocks)
        return served / max(self.input_tokens, 1)

    def summary(self) -> dict[str, float | int | str]:
        return {"name": self.name, "requests": len(self), "input_tokens": self.input_tokens,
                "block_tokens": self.block_tokens, "unique_blocks": self.unique_blocks(),
                "duration_s": self.duration_s(), "infinite_share": self.infinite_share()}


def _parse(line: str, where: str) -> TraceRequest:
    try:
        obj = json.loads(line)
        blocks = tuple(int(b) for b in obj["hash_ids"])
        hint = strongest((openai_hint(obj.get("prompt_cache_key"),
                                      obj.get("prompt_cache_retention")),
                          cache_control_hint(obj.get("cache_control"))))
        request = TraceRequest(int(obj["timestamp"]), int(obj["input_length"]),
                               int(obj.get("output_length", 0)), blocks, hint,
                               str(obj.get("tenant", "")))
    except HintError as exc:
        raise ConfigError("trace", where, f"valid cache hints ({exc})") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError("trace", where, "a JSON object with timestamp, input_length and "
                          f"hash_ids ({type(exc).__name__}: {exc})") from None
    if request.input_tokens < 0 or any(b < 0 or b >= 1 << 32 for b in blocks):
        raise ConfigError("trace", where, "a non-negative input_length and uint32 hash_ids")
    return request


def parse_lines(lines: Iterable[str], block_tokens: int = DEFAULT_BLOCK_TOKENS,
                name: str = "trace", limit: int | None = None) -> Trace:
    """A trace from JSON lines (blank lines skipped), sorted by timestamp."""
    if block_tokens < 1:
        raise ConfigError("block_tokens", block_tokens, "an integer >= 1")
    requests: list[TraceRequest] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        requests.append(_parse(line, f"{name} line {number}"))
        if limit is not None and len(requests) >= limit:
            break
    requests.sort(key=lambda r: r.timestamp_ms)
    return Trace(tuple(requests), block_tokens, name)


def read_trace(path: str | Path, block_tokens: int = DEFAULT_BLOCK_TOKENS,
               limit: int | None = None) -> Trace:
    """Read a JSON-lines trace file (the first ``limit`` requests if given)."""
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as handle:
            return parse_lines(handle, block_tokens, path.stem, limit)
    except OSError as exc:
        raise ConfigError("trace", str(path), f"a readable file ({exc.strerror})") from None


def write_trace(path: str | Path, requests: Sequence[TraceRequest]) -> Path:
    """Write requests as JSON lines (the format ``read_trace`` reads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(r.to_json() + "\n" for r in requests), encoding="utf-8")
    return path
