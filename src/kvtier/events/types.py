"""KV event types as plain objects, with the field names and order of vLLM 0.32's wire format.

Owns ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared`` (frozen dataclasses a vLLM
connector can turn into vLLM's own classes field by field), ``TIER_PLACEMENT`` (kvtier tier ->
``medium`` and ``locality`` as cache-aware routers read them) and ``WIRE_FIELDS``, the order in
which the encoder writes each event's map. Pure data; any thread.

The format (vLLM ``vllm/distributed/kv_events.py`` of 0.32): each event is a msgpack map whose
first key is ``"type"`` (the class name), then the fields in declaration order; fields that have
a default (``locality`` and ``ownership`` here) are left out while they hold it, the others are
always written (``None`` as nil).
"""

from __future__ import annotations

from dataclasses import dataclass

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
LOCALITY_LOCAL = "LOCAL"
LOCALITY_REMOTE = "REMOTE"

#: kvtier tier -> (medium, locality). The device pool is the engine's primary tier (``GPU``, as
#: vLLM's own block pool reports it, whatever device it runs on); the host pool is ``CPU``; disk
#: and Redis are both ``STORAGE``, told apart by ``locality``.
TIER_PLACEMENT: dict[str, tuple[str, str | None]] = {
    "device": (MEDIUM_GPU, None),
    "host": (MEDIUM_CPU, None),
    "disk": (MEDIUM_STORAGE, LOCALITY_LOCAL),
    "remote": (MEDIUM_STORAGE, LOCALITY_REMOTE),
}

#: Wire order of each event's fields after ``"type"``; the fields after ``|`` are optional
#: (written only when not None).
WIRE_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "BlockStored": (("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                     "medium", "lora_name"), ("locality", "ownership")),
    "BlockRemoved": (("block_hashes", "medium"), ("locality", "ownership")),
    "AllBlocksCleared": ((), ()),
}


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive blocks of one prefix now held on ``medium`` (``parent_block_hash``: the
    block before the first, None at the start of a prompt)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks no longer held on ``medium``."""

    block_hashes: list[int]
    medium: str | None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Forget every block this publisher announced (what it still holds is stored again next)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
