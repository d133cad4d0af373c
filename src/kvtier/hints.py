"""Cache hints as the API providers define them, parsed into one soft ``CacheHint``.

Owns ``CacheHint`` and the parsers of the two wire forms kvtier accepts:

- OpenAI: ``prompt_cache_key`` (an affinity key: requests that share it share a prefix) and
  ``prompt_cache_retention`` (``"in_memory"``: minutes; ``"24h"``: a day);
- Anthropic: ``cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}`` (``ttl`` optional,
  5 minutes by default), on a message or on the request.

A hint is a *wish*, never a pin: the cache turns its retention into a head start in the
eviction order that decays as new content arrives and that one tenant's hints can only claim a
bounded share of (``kvtier.controller.hints``). A value outside the provider's vocabulary is a
``HintError`` naming the field, which the server answers with a 400. No torch; any thread.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

#: retention words -> seconds. ``in_memory``: OpenAI keeps such prefixes 5-10 minutes, up to an
#: hour off-peak; its lower bound is the promise. ``24h``, ``5m``, ``1h``: as named.
OPENAI_RETENTION: dict[str, float] = {"in_memory": 300.0, "24h": 86_400.0}
ANTHROPIC_TTL: dict[str, float] = {"5m": 300.0, "1h": 3_600.0}
MAX_KEY_CHARS = 256


class HintError(ValueError):
    """A cache hint field holds a value outside its vocabulary."""

    def __init__(self, field: str, value: Any, expected: str) -> None:
        super().__init__(f"{field}: {value!r} is not a valid cache hint (expected {expected})")
        self.field = field


@dataclass(frozen=True)
class CacheHint:
    """How long the caller would like the request's prefix kept, and its affinity key."""

    retention_s: float
    key: str | None = None
    source: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"retention_s": self.retention_s, "key": self.key, "source": self.source}


def openai_hint(key: Any, retention: Any) -> CacheHint | None:
    """The hint of OpenAI's two fields (either may be None); a key alone asks for
    ``in_memory`` retention, which is what OpenAI gives every cached prefix."""
    if key is not None and (not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS):
        raise HintError("prompt_cache_key", key, f"a string of 1 to {MAX_KEY_CHARS} characters")
    if retention is not None and (not isinstance(retention, str)
                                  or retention not in OPENAI_RETENTION):
        raise HintError("prompt_cache_retention", retention,
                        " or ".join(repr(k) for k in OPENAI_RETENTION))
    if key is None and retention is None:
        return None
    return CacheHint(OPENAI_RETENTION[retention or "in_memory"], key, "openai")


def cache_control_hint(value: Any, field: str = "cache_control") -> CacheHint | None:
    """The hint of one Anthropic-style ``cache_control`` object (None when absent)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "ephemeral":
        raise HintError(f"{field}.type", value.get("type") if isinstance(value, dict) else value,
                        "'ephemeral'")
    unknown = sorted(set(value) - {"type", "ttl"})
    if unknown:
        raise HintError(f"{field}.{unknown[0]}", value[unknown[0]], "only 'type' and 'ttl'")
    ttl = value.get("ttl", "5m")
    if not isinstance(ttl, str) or ttl not in ANTHROPIC_TTL:
        raise HintError(f"{field}.ttl", ttl, " or ".join(repr(k) for k in ANTHROPIC_TTL))
    return CacheHint(ANTHROPIC_TTL[ttl], None, "cache_control")


def strongest(hints: Iterable[CacheHint | None]) -> CacheHint | None:
    """One hint for a request: the longest retention, keeping the first affinity key given."""
    given = [h for h in hints if h is not None]
    if not given:
        return None
    best = max(given, key=lambda h: h.retention_s)
    key = next((h.key for h in given if h.key), None)
    return CacheHint(best.retention_s, key, best.source)
