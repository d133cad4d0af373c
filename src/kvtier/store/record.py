"""The page record header shared by every persistent store (disk segments, Redis values).

Owns the 64-byte header that travels with each stored page and its verification. A page is
served only if its header is intact, names the key asked for, has the expected length, and the
payload's checksum matches; anything else is a torn, corrupt or foreign record. Pure Python +
xxhash; called from IO worker threads.

Header layout (little-endian)::

    0   4  magic  b"KVTR"
    4   2  record format version
    6   2  header size (64)
    8   4  flags (0; a disk segment puts the payload's place there, see ``file.segment``)
    12  8  payload length
    20  8  payload checksum: xxh3_64
    28 32  page key
    60  4  header checksum: crc32 of bytes 0..60

xxh3_64 runs at memory speed, so verifying every read costs little next to the read itself; it
guards against torn writes and bit rot, not against an attacker with write access to the store
(keys are SHA-256, so a tenant cannot address another tenant's pages).
"""

from __future__ import annotations

import struct
import zlib
from enum import Enum

import xxhash

from kvtier.keys import KEY_BYTES

MAGIC = b"KVTR"
RECORD_VERSION = 1
HEADER_BYTES = 64
_STRUCT = struct.Struct("<4sHHIQQ32s")  # 60 bytes, then the crc32
assert _STRUCT.size == 60


class Verdict(Enum):
    OK = "ok"
    TORN = "torn"          # header unreadable, bad magic, or bad header checksum
    FOREIGN = "foreign"    # intact header for another key or another format version
    CORRUPT = "corrupt"    # intact header, but the payload length or checksum does not match


def payload_checksum(payload: bytes | bytearray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def encode_header(key: bytes, payload: bytes | bytearray | memoryview,
                  checksum: int | None = None, flags: int = 0) -> bytes:
    """The 64-byte header for ``payload`` stored under ``key`` (``flags``: see the layout)."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"key must be {KEY_BYTES} bytes")
    length = memoryview(payload).nbytes
    digest = payload_checksum(payload) if checksum is None else checksum
    body = _STRUCT.pack(MAGIC, RECORD_VERSION, HEADER_BYTES, flags, length, digest, bytes(key))
    return body + struct.pack("<I", zlib.crc32(body))


def decode_header(header: bytes | bytearray | memoryview) -> tuple[bytes, int, int] | None:
    """(key, payload length, payload checksum), or None if the header is torn."""
    view = memoryview(header)
    if view.nbytes < HEADER_BYTES:
        return None
    body = bytes(view[:60])
    (crc,) = struct.unpack("<I", view[60:64])
    if zlib.crc32(body) != crc:
        return None
    magic, version, size, _flags, length, digest, key = _STRUCT.unpack(body)
    if magic != MAGIC or size != HEADER_BYTES:
        return None
    if version != RECORD_VERSION:
        return (b"", length, digest)  # reads as foreign
    return key, length, digest


def verify(header: bytes | bytearray | memoryview, key: bytes,
           payload: bytes | bytearray | memoryview) -> Verdict:
    """Check a record read back from a store against the key it was asked for."""
    decoded = decode_header(header)
    if decoded is None:
        return Verdict.TORN
    stored_key, length, digest = decoded
    if stored_key != bytes(key):
        return Verdict.FOREIGN
    if length != memoryview(payload).nbytes or payload_checksum(payload) != digest:
        return Verdict.CORRUPT
    return Verdict.OK
