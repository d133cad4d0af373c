"""KV events on the wire: vLLM 0.32's map-encoded events in an array batch, byte for byte."""

from __future__ import annotations

import hashlib

import pytest

from events_support import msgpack, msgspec_types
from kvtier.errors import ConfigError
from kvtier.events.blocks import BlockNamer, key_hash
from kvtier.events.encode import encode_batch, event_map
from kvtier.events.types import AllBlocksCleared, BlockRemoved, BlockStored
from kvtier.keys import token_bytes

STORED = BlockStored([2**64 - 1, 7], None, list(range(8)), 4, None, "GPU", None)
REMOTE = BlockStored([11], 2**63 + 5, [9, 9, 9, 9], 4, None, "STORAGE", None, "REMOTE")
REMOVED = BlockRemoved([2**64 - 1], "CPU")
REMOVED_REMOTE = BlockRemoved([11], "STORAGE", "REMOTE")


def test_event_map_keys_follow_vllm_field_order_with_type_first():
    assert list(event_map(STORED)) == ["type", "block_hashes", "parent_block_hash", "token_ids",
                                       "block_size", "lora_id", "medium", "lora_name"]
    assert list(event_map(REMOTE))[-1] == "locality"
    assert list(event_map(REMOVED)) == ["type", "block_hashes", "medium"]
    assert event_map(REMOVED_REMOTE)["locality"] == "REMOTE"
    assert event_map(AllBlocksCleared()) == {"type": "AllBlocksCleared"}


def test_batch_decodes_with_a_plain_msgpack_decoder_as_ts_events_rank():
    payload = encode_batch(12.5, [STORED, REMOVED, AllBlocksCleared()], 0)
    ts, events, rank = msgpack.unpackb(payload)
    assert (ts, rank) == (12.5, 0)
    assert [e["type"] for e in events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert events[0]["block_hashes"] == [2**64 - 1, 7]
    assert events[0]["parent_block_hash"] is None and events[0]["lora_id"] is None
    assert events[0]["token_ids"] == list(range(8)) and events[0]["block_size"] == 4


def test_payload_is_byte_identical_to_msgspec_structs_of_the_vllm_format():
    vllm = msgspec_types()
    if vllm is None:
        pytest.skip("msgspec is not installed")
    ours = encode_batch(3.25, [STORED, REMOTE, REMOVED, REMOVED_REMOTE, AllBlocksCleared()], 0)
    theirs = vllm.encoder.encode(vllm.EventBatch(3.25, [
        vllm.BlockStored([2**64 - 1, 7], None, list(range(8)), 4, None, "GPU", None),
        vllm.BlockStored([11], 2**63 + 5, [9] * 4, 4, None, "STORAGE", None, locality="REMOTE"),
        vllm.BlockRemoved([2**64 - 1], "CPU"),
        vllm.BlockRemoved([11], "STORAGE", locality="REMOTE"),
        vllm.AllBlocksCleared()], 0))
    assert ours == theirs
    batch = vllm.decoder.decode(ours)
    assert isinstance(batch.events[1], vllm.BlockStored) and batch.events[1].locality == "REMOTE"
    assert isinstance(batch.events[4], vllm.AllBlocksCleared)


def test_block_hash_is_the_last_8_bytes_of_the_page_key_big_endian():
    key = hashlib.sha256(b"page").digest()
    namer = BlockNamer(page_size=4)
    assert namer.hashes(key + key[::-1]) == [int.from_bytes(key[24:], "big"),
                                              int.from_bytes(key[::-1][24:], "big")]
    assert namer.parent_hash(key) == key_hash(key) and namer.parent_hash(None) is None


def test_router_block_size_splits_each_page_and_keeps_the_page_hash_last():
    keys = [hashlib.sha256(bytes([i])).digest() for i in range(2)]
    namer = BlockNamer(page_size=8, block_size=2)
    hashes = namer.hashes(b"".join(keys))
    assert len(hashes) == 8 and len(set(hashes)) == 8
    assert hashes[3] == key_hash(keys[0]) and hashes[7] == key_hash(keys[1])
    assert hashes[:4] == namer.hashes(keys[0])  # a function of the page key alone


def test_token_ids_come_back_from_the_index_bytes():
    assert BlockNamer.token_ids(token_bytes([1, 70000, 2**32 - 1])) == [1, 70000, 2**32 - 1]


@pytest.mark.parametrize("block_size", [3, -1, 16])
def test_a_router_block_size_that_does_not_divide_the_page_is_refused(block_size):
    with pytest.raises(ConfigError, match="kv_events_block_size"):
        BlockNamer(page_size=8, block_size=block_size)
