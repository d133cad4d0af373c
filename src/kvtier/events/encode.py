"""The msgpack encoding of KV event batches, byte for byte as vLLM 0.32's publisher writes them.

Owns ``encode_batch`` and ``event_map``. A batch is the msgpack array ``[ts, [events...],
data_parallel_rank]`` (vLLM's ``EventBatch`` is an array-like struct); each event is a map whose
first key is ``"type"``, then the fields in ``WIRE_FIELDS`` order, optional ones only when set
(see ``kvtier.events.types``). msgpack is imported on first use, so kvtier imports without it
(``pip install 'kvtier[events]'``). Runs on the publisher thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.errors import ConfigError
from kvtier.events.types import WIRE_FIELDS, KVEvent


def event_map(event: KVEvent) -> dict[str, Any]:
    """The event as the ordered map that goes on the wire."""
    name = type(event).__name__
    required, optional = WIRE_FIELDS[name]
    out: dict[str, Any] = {"type": name}
    for field in required:
        out[field] = getattr(event, field)
    for field in optional:
        value = getattr(event, field)
        if value is not None:
            out[field] = value
    return out


def encode_batch(ts: float, events: Sequence[KVEvent], data_parallel_rank: int = 0) -> bytes:
    """One batch's payload (the third frame of a published message)."""
    return _pack([float(ts), [event_map(e) for e in events], data_parallel_rank])


def _pack(value: Any) -> bytes:
    return msgpack_module().packb(value, use_bin_type=True)


def msgpack_module() -> Any:
    try:
        import msgpack
    except ImportError:
        raise ConfigError("server.kv_events_endpoint", "set",
                          "only with msgpack installed (pip install 'kvtier[events]')") from None
    return msgpack
