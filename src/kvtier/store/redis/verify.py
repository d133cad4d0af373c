"""The integrity verdict on the GET replies of a Redis page store: hit, miss, corrupt or error.

Owns ``PageJudge``. A reply is a hit only if the stored record header is exactly the header a
writer makes (``record.encode_header``) for the key asked for and the payload that arrived, so a
truncated, flipped, foreign or wrongly typed value is a corrupt miss. ``PageJudge`` builds those
headers faster than ``encode_header`` does: the leading fields that depend on neither key nor
payload are encoded once per page size, leaving per page the payload checksum, the key and the
header's crc32. The shortcut is checked against ``encode_header`` and ``payload_checksum`` when
the judge is built; if the layout or checksum it assumes ever differ, every header comes from
``encode_header``. Writes take their headers from the same builder. Pure Python plus xxhash and
zlib; runs on the IO worker thread that called the store.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import xxhash

from kvtier.keys import KEY_BYTES
from kvtier.store.record import HEADER_BYTES, encode_header, payload_checksum
from kvtier.store.redis.endpoint import MOVED_KINDS
from kvtier.store.redis.wire import Reply, ServerError

_CRC_BYTES = 4
_CHECKSUM_BYTES = 8
_LEAD_BYTES = HEADER_BYTES - _CRC_BYTES - KEY_BYTES - _CHECKSUM_BYTES  # magic ... length


class Verdicts:
    """What a batch of replies came to: hits per page, the pages whose values failed
    verification (``bad``) and the counts of the rest."""

    __slots__ = ("found", "bad", "errors", "moved")

    def __init__(self, count: int) -> None:
        self.found = [False] * count
        self.bad: list[int] = []  # pages whose stored value is damaged, foreign or of a wrong type
        self.errors = 0
        self.moved = False  # a MOVED / ASK reply: the cluster's slot map changed

    @property
    def corrupt(self) -> int:
        return len(self.bad)


class PageJudge:
    """Judges GET replies of ``page_bytes`` records."""

    def __init__(self, page_bytes: int) -> None:
        self.page_bytes = page_bytes
        sample = memoryview(bytearray(page_bytes))
        self._lead = encode_header(bytes(KEY_BYTES), sample, 0)[:_LEAD_BYTES]
        probes = [(bytes(range(KEY_BYTES)), 0x0123456789ABCDEF), (b"\xff" * KEY_BYTES, 1)]
        sample[:1] = b"k"
        self._fast = payload_checksum(sample) == xxhash.xxh3_64_intdigest(sample) and all(
            self._quick(key, digest) == encode_header(key, sample, digest)
            for key, digest in probes)

    def _quick(self, key: bytes, digest: int) -> bytes:
        body = self._lead + digest.to_bytes(_CHECKSUM_BYTES, "little") + key
        return body + zlib.crc32(body).to_bytes(_CRC_BYTES, "little")

    def expected_header(self, key: bytes, payload: memoryview) -> bytes:
        """The header a writer stores with ``payload`` under ``key``."""
        if self._fast:
            return self._quick(bytes(key), xxhash.xxh3_64_intdigest(payload))
        return encode_header(key, payload, payload_checksum(payload))

    def judge(self, keys: Sequence[bytes], replies: Sequence[Reply],
              views: Sequence[memoryview], out: Verdicts, where: Sequence[int]) -> None:
        """Record in ``out`` the verdict on ``replies[j]`` for page ``where[j]`` (a reply is
        the header, ``None`` for nil, an int for a value of another size, or an error)."""
        found, expected = out.found, self.expected_header
        lead, digest_of, crc32 = self._lead, xxhash.xxh3_64_intdigest, zlib.crc32
        for i, reply in zip(where, replies, strict=True):
            if type(reply) is bytes:
                key, view = keys[i], views[i]
                if self._fast and type(key) is bytes:  # expected_header, inlined
                    body = lead + digest_of(view).to_bytes(_CHECKSUM_BYTES, "little") + key
                    header = body + crc32(body).to_bytes(_CRC_BYTES, "little")
                else:
                    header = expected(key, view)
                if reply == header:
                    found[i] = True
                else:
                    out.bad.append(i)
            elif reply is None:
                continue
            elif isinstance(reply, ServerError):
                out.moved |= reply.kind in MOVED_KINDS
                if reply.kind == "WRONGTYPE":
                    out.bad.append(i)
                else:
                    out.errors += 1
            else:  # the length of a value of another size
                out.bad.append(i)
