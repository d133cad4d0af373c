"""Page keys: content hashes that name a page of KV anywhere (device, host, disk, remote).

Owns ``PageKey``, ``KeyNamespace`` and ``page_keys``. Pure Python (hashlib, array), no torch;
called on the engine thread.

The hash is SHA-256 from the standard library: it is cryptographic (a tenant cannot craft a
collision to read another prefix's KV), identical in every process, host and Python hash seed,
hardware-accelerated on current x86 and Arm CPUs, and present on every machine kvtier runs on
without an extra wheel (blake3 is not). Keys form a chain so that a page's key names its whole
prefix::

    key_0     = SHA256(seed || tokens of page 0 as little-endian uint32)
    key_i     = SHA256(key_{i-1} || tokens of page i as little-endian uint32)
    seed      = SHA256("kvtier-namespace" || canonical namespace fields [|| "salt" || salt])

Only full pages get keys: a partial last page is recomputed, never stored.
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

from kvtier.errors import ConfigError

#: Version of the on-store page format. Part of every namespace: bumping it invalidates all keys.
FORMAT_VERSION = 1

KEY_BYTES = 32

_sha256 = hashlib.sha256


class PageKey(bytes):
    """An immutable 32-byte page key. ``str(key)`` and ``key.hex()`` give its stable hex form."""

    __slots__ = ()

    def __new__(cls, value: bytes | bytearray | memoryview) -> PageKey:
        if len(value) != KEY_BYTES:
            raise ValueError(f"a PageKey is {KEY_BYTES} bytes, got {len(value)}")
        return super().__new__(cls, value)

    @classmethod
    def from_hex(cls, text: str) -> PageKey:
        return cls(bytes.fromhex(text))

    def __str__(self) -> str:
        return self.hex()

    def __repr__(self) -> str:
        return f"PageKey({self.hex()[:16]}…)"


@dataclass(frozen=True, slots=True)
class KeyNamespace:
    """Everything that must match for two processes to share a page.

    ``model`` names the model; ``model_fingerprint`` identifies its weights and config (a hash of
    the config and weight file digests, say), so two fine-tunes of one base never share KV.
    ``layout`` is ``KVLayout.fingerprint()`` of the *full* model (not a rank's share): stored
    pages are layout-neutral and ranks read their slice of them.
    """

    model: str
    model_fingerprint: str
    kv_dtype: str
    layout: str
    page_size: int
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("namespace.model", self.model, "a non-empty model name")
        if self.page_size < 1:
            raise ConfigError("namespace.page_size", self.page_size, "an integer >= 1")

    def canonical(self) -> bytes:
        """Length-prefixed fields, so no two different namespaces encode the same bytes."""
        fields: tuple[object, ...] = (
            self.model, self.model_fingerprint, self.kv_dtype, self.layout,
            str(self.page_size), str(self.format_version),
        )
        out = bytearray()
        for field in fields:
            data = str(field).encode("utf-8")
            out += len(data).to_bytes(4, "little") + data
        return bytes(out)

    def seed(self, salt: bytes | str | None = None) -> bytes:
        """The chain's starting value; a tenant salt gives a disjoint keyspace."""
        h = _sha256(b"kvtier-namespace\0")
        h.update(self.canonical())
        if salt is not None and salt != b"" and salt != "":
            data = salt.encode("utf-8") if isinstance(salt, str) else bytes(salt)
            h.update(b"salt\0" + len(data).to_bytes(4, "little") + data)
        return h.digest()

    def short_id(self) -> str:
        """A short stable hex id of this namespace (no salt), for store prefixes and file names."""
        return self.seed().hex()[:16]


class TokenArray(Protocol):
    """A numpy or torch integer array of token ids, by its shape (this layer imports neither)."""

    @property
    def shape(self) -> tuple[int, ...]: ...


#: Token ids as the cache takes them: a sequence of ints (list, tuple, ``array``) or a numpy or
#: torch integer array (``kvtier.index.radix.as_token_bytes`` also takes their uint32 bytes).
Tokens: TypeAlias = "Sequence[int] | TokenArray"


def token_bytes(tokens: Tokens) -> bytes:
    """Tokens as little-endian uint32 bytes. Accepts a list, tuple, array or numpy/torch array."""
    duck: Any = tokens  # numpy and torch arrays are told apart by their methods
    if hasattr(duck, "numpy"):  # torch tensor
        duck = duck.detach().cpu().numpy()
    if hasattr(duck, "astype"):  # numpy array
        return bytes(duck.astype("<u4", copy=False).tobytes())
    packed = array.array("I", duck)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def page_keys(
    tokens: Tokens,
    page_size: int,
    namespace: KeyNamespace,
    salt: bytes | str | None = None,
) -> list[PageKey]:
    """Keys of every full page of ``tokens``; a partial last page gets none."""
    if page_size != namespace.page_size:
        raise ConfigError("page_size", page_size, f"the namespace's page size {namespace.page_size}")
    return chain_keys(token_bytes(tokens), page_size, namespace.seed(salt))


def chain_keys(data: bytes, page_size: int, seed: bytes) -> list[PageKey]:
    """Continue a key chain from ``seed`` over ``data`` (uint32 LE tokens).

    With ``seed`` set to the last key of an earlier prefix, this extends that prefix's keys
    without rehashing it.
    """
    step = page_size * 4
    full = len(data) // step * step
    out: list[PageKey] = []
    append = out.append
    new_key = bytes.__new__  # digests are always 32 bytes: skip PageKey's length check
    prev = seed
    for offset in range(0, full, step):
        prev = _sha256(prev + data[offset:offset + step]).digest()
        append(new_key(PageKey, prev))
    return out
