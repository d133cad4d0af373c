"""Router block names and sizes: kvtier page keys as vLLM-style integer block hashes.

Owns ``BlockNamer``, which turns what the index recorded about a run of pages (its tokens as
uint32 little-endian bytes, its 32-byte SHA-256 chain keys, its parent's last key) into the
fields of ``BlockStored`` / ``BlockRemoved``. Runs wherever events are materialised (the
publisher thread, or the thread calling ``EventRecorder.take``), never on the engine thread.

A block hash is the last 8 bytes of a key read big-endian, the rule vLLM applies to its own
SHA-256 block hashes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, the default), so hashes are
stable across processes and chained: a page's key names its whole prefix. With a router block
size smaller than the page, page ``K`` becomes ``page_size / block_size`` blocks; the last one
carries ``K``'s hash and block ``j`` before it ``SHA256(K || j)``, so every block name is still
a function of the prefix up to it.
"""

from __future__ import annotations

import hashlib
import sys
from array import array

from kvtier.errors import ConfigError
from kvtier.keys import KEY_BYTES

_MASK = (1 << 64) - 1
_U32 = "I" if array("I").itemsize == 4 else "L"


def key_hash(key: bytes) -> int:
    """The integer block hash of one 32-byte page key (its last 8 bytes, big-endian)."""
    return int.from_bytes(key[-8:], "big")


class BlockNamer:
    """Block hashes and token lists for pages of ``page_size`` tokens cut into ``block_size``."""

    def __init__(self, page_size: int, block_size: int = 0) -> None:
        block_size = block_size or page_size
        if block_size < 1 or page_size % block_size:
            raise ConfigError("server.kv_events_block_size", block_size,
                              f"0 or a divisor of the page size ({page_size})")
        self.page_size = page_size
        self.block_size = block_size
        self.per_page = page_size // block_size

    def hashes(self, keys: bytes) -> list[int]:
        """Block hashes of every page whose keys are concatenated in ``keys``."""
        out: list[int] = []
        per_page = self.per_page
        for offset in range(0, len(keys), KEY_BYTES):
            key = keys[offset:offset + KEY_BYTES]
            for j in range(per_page - 1):
                digest = hashlib.sha256(key + j.to_bytes(2, "big")).digest()
                out.append(int.from_bytes(digest[-8:], "big") & _MASK)
            out.append(key_hash(key))
        return out

    def parent_hash(self, parent_key: bytes | None) -> int | None:
        """Hash of the block before a run: the last block of the parent page."""
        return None if parent_key is None else key_hash(parent_key)

    @staticmethod
    def token_ids(tokens: bytes) -> list[int]:
        ids = array(_U32)
        ids.frombytes(tokens)
        if sys.byteorder != "little":
            ids.byteswap()
        return ids.tolist()
