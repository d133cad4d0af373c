"""Helpers for the KV event tests: a subscriber's view of a decoded stream, the index's own view,
and msgspec structs written from vLLM 0.32's format description (``kvtier.events.types``).

A view maps ``(medium, locality)`` to ``{block_hash: token_ids}``: what a cache-aware router
believes one publisher holds on each tier.
"""

from collections import defaultdict
from typing import Any

import pytest

from kvtier.events.blocks import BlockNamer
from kvtier.events.types import TIER_PLACEMENT
from kvtier.index.residency import TIERS

msgpack = pytest.importorskip("msgpack")

View = dict[tuple[str, Any], dict[int, list[int]]]


def new_view() -> View:
    return defaultdict(dict)


def apply_payload(view: View, payload: bytes) -> list[dict[str, Any]]:
    """Decode one batch with a plain msgpack decoder and apply it; returns its events."""
    ts, events, rank = msgpack.unpackb(payload)
    assert isinstance(ts, float) and rank == 0
    for event in events:
        apply_event(view, event)
    return events


def apply_event(view: View, event: dict[str, Any]) -> None:
    kind = event["type"]
    if kind == "AllBlocksCleared":
        view.clear()
        return
    where = view[(event["medium"], event.get("locality"))]
    if kind == "BlockRemoved":
        for h in event["block_hashes"]:
            assert h in where, f"removal of a block never stored on {event['medium']}: {h}"
            del where[h]
        return
    assert kind == "BlockStored", kind
    size = event["block_size"]
    parent = event["parent_block_hash"]
    assert parent is None or parent in where, "a stored run whose parent the tier does not hold"
    tokens = event["token_ids"]
    assert len(tokens) == size * len(event["block_hashes"])
    for i, h in enumerate(event["block_hashes"]):
        where[h] = tokens[i * size:(i + 1) * size]


def index_view(index: Any, namer: BlockNamer) -> View:
    """What the index holds, in the same terms."""
    view = new_view()
    for node in index.iter_nodes():
        hashes = namer.hashes(node.keys)
        tokens = namer.token_ids(node.tokens)
        size = namer.block_size
        for t, value in enumerate(node.res):
            if value is not None:
                where = view[TIER_PLACEMENT[TIERS[t]]]
                for i, h in enumerate(hashes):
                    where[h] = tokens[i * size:(i + 1) * size]
    return view


def plain(view: View) -> dict[tuple[str, Any], dict[int, list[int]]]:
    return {k: dict(v) for k, v in view.items() if v}


try:
    import msgspec
except ImportError:
    msgspec = None

if msgspec is not None:
    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class VBlockStored(Event, tag="BlockStored"):
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        locality: str | None = None
        ownership: str | None = None
        session_id: str | None = None

    class VBlockRemoved(Event, tag="BlockRemoved"):
        block_hashes: list[int | bytes]
        medium: str | None
        group_idx: int | None = None
        locality: str | None = None
        ownership: str | None = None

    class VAllBlocksCleared(Event, tag="AllBlocksCleared"):
        pass

    class KVEventBatch(EventBatch):
        events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


def msgspec_types() -> Any:
    """vLLM 0.32's event structs, written from the format description (None without msgspec)."""
    if msgspec is None:
        return None
    return type("VllmTypes", (), {"EventBatch": KVEventBatch, "BlockStored": VBlockStored,
                                  "BlockRemoved": VBlockRemoved,
                                  "AllBlocksCleared": VAllBlocksCleared,
                                  "decoder": msgspec.msgpack.Decoder(KVEventBatch),
                                  "encoder": msgspec.msgpack.Encoder()})
