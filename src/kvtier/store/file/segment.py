"""Segment files of the ``file://`` store: the record layout and the store's manifest.

Owns ``RecordLayout`` (where a page's header, chunk-checksum table and payload sit inside a
segment, and how a record is encoded and verified) and the manifest (``kvtier-store.json``)
that fixes the layout of a store directory once, at creation. Pure arithmetic and small file
operations; called from IO worker threads and from the thread that opens the store.

A segment is one append-only file of fixed-size slots, ``segments/<id>.seg``::

    [header table: slot 0's header, slot 1's header, ...][pad to 4 KiB]
    [payload of slot 0][pad to align][payload of slot 1][pad to align]...

A slot's header is the 64-byte record header (``kvtier.store.record``: format version, key,
length, payload checksum; its flags field holds the payload's *place*, its file offset / 512, so
a header read through a layout other than the one that wrote it never vouches for bytes read
from another offset, even when the payload checksum is skipped), followed, for pages larger than
one chunk, by a table of xxh3 checksums, one per chunk, so a partial read (a pipeline stage's
layers) verifies only the chunks it reads. Headers sit apart from payloads so that payloads
start on page boundaries (``align``: 4 KiB for pages of 64 KiB and more, else 512 B): a page is
then written and read as whole page-cache pages, and O_DIRECT can move it straight into an
aligned buffer. Measured on the 2-core machine at 64 KiB pages, an inline 64-byte header before
each payload cost about 50% more CPU per buffered write and 20% more per read than this layout
(the payload then straddles one more page-cache page). """

from __future__ import annotations

import functools
import json
import os
import struct
import sys
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from kvtier.errors import LayoutMismatch, StoreCorrupt, StoreUnavailable
from kvtier.keys import KEY_BYTES
from kvtier.store.quarantine import identity
from kvtier.store.record import HEADER_BYTES, MAGIC, RECORD_VERSION, Verdict, encode_header

MANIFEST = "kvtier-store.json"
FORMAT = "kvtier-file-store"
FORMAT_VERSION = 2  # 2: record headers carry the payload's place (1: flags 0, still read)
PLACE_UNIT = 512  # a place is a payload offset in these units (payloads are 512-aligned)
CHUNK_BYTES = 64 << 10
#: ``kvtier.store.record``'s header, crc included, unpacked in one call on the read path
#: (tests check that it agrees with ``encode_header``).
_HEADER = struct.Struct("<4sHHIQQ32sI")
assert _HEADER.size == HEADER_BYTES
SEGMENT_SUFFIX = ".seg"
#: The header's first 8 bytes: magic, version, header size.
_HEAD_BYTES = struct.pack("<4sHH", MAGIC, RECORD_VERSION, HEADER_BYTES)
_KEY_DTYPE = np.dtype("V32")
_BIG_ENDIAN = sys.byteorder == "big"
#: crc32 of a whole 64-byte header (body, then the little-endian crc32 of the body): the same
#: value for every header whose crc holds (the CRC-32 residue).
_RESIDUE = zlib.crc32(bytes(60) + struct.pack("<I", zlib.crc32(bytes(60))))


@functools.cache
def _header_fields(stride: int) -> np.dtype:
    """One header-table entry (``stride`` bytes) as the byte fields verification compares
    (they overlap: ``header`` is all 64 bytes, ``fixed`` the first 20)."""
    return np.dtype({"names": ["header", "fixed", "head", "flags", "length", "digest", "key"],
                     "formats": ["V64", "V20", "V8", "<u4", "V8", "V8", _KEY_DTYPE],
                     "offsets": [0, 0, 0, 8, 12, 20, 28], "itemsize": stride})


#: Bytes 0..20 of a header: magic, version, header size; flags (the place); payload length.
_FIXED = np.dtype({"names": ["head", "flags", "length"], "formats": ["V8", "<u4", "<u8"],
                   "offsets": [0, 8, 12], "itemsize": 20})
#: Slots per cached run of expected header bytes (80 KB each; a read run spans at most two).
_FIXED_SLOTS = 4096


@functools.lru_cache(maxsize=64)
def _fixed_block(layout: RecordLayout, block: int) -> bytes:
    """Bytes 0..20 of the headers of slots ``block * _FIXED_SLOTS ...`` as written: built once
    (numpy), then sliced on every batch read, which keeps the place check off the hot path."""
    fixed = np.empty(_FIXED_SLOTS, _FIXED)
    fixed["head"] = np.frombuffer(_HEAD_BYTES, "V8")
    slots = np.arange(block * _FIXED_SLOTS, (block + 1) * _FIXED_SLOTS, dtype=np.uint64)
    fixed["flags"] = ((layout.table_bytes + slots * layout.payload_stride) // PLACE_UNIT
                      if layout.places else 0)
    fixed["length"] = layout.page_bytes
    return fixed.tobytes()


@functools.cache
def _crc_of_intact(count: int) -> int:
    """crc32 of ``count`` intact 64-byte headers back to back. CRC-32 is affine, so this
    depends only on each header's own crc32, which is ``_RESIDUE`` for every intact one."""
    body = bytes(60)
    return zlib.crc32((body + struct.pack("<I", zlib.crc32(body))) * count)


def _crcs_hold(headers: bytes | bytearray, count: int) -> np.ndarray | bool:
    """Whether each of ``count`` 64-byte headers (back to back) matches its crc: one crc32
    over all of them when all hold (a damaged header changes it: shifting a CRC by zero
    bytes is invertible), else one per header."""
    if zlib.crc32(headers) == _crc_of_intact(count):
        return True
    crc = zlib.crc32
    return np.fromiter([crc(headers[at:at + HEADER_BYTES]) == _RESIDUE
                        for at in range(0, count * HEADER_BYTES, HEADER_BYTES)], bool, count)


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class RecordLayout:
    """The fixed geometry of every record and segment of one store directory."""

    page_bytes: int
    align: int
    slots: int  # records per segment
    chunk_bytes: int = CHUNK_BYTES
    places: bool = True  # headers carry their payload's place (False: stores of format 1)
    # Derived once (read on every IO).
    header_stride: int = field(init=False)   # bytes per slot in the header table (power of 2)
    table_bytes: int = field(init=False)     # the header table, padded to 4 KiB
    payload_stride: int = field(init=False)  # bytes per slot in the payload area
    record_bytes: int = field(init=False)    # disk bytes per slot, header share included

    def __post_init__(self) -> None:
        header = HEADER_BYTES + 8 * self.chunks
        stride = 64
        while stride < header:
            stride *= 2
        if stride > 4096:
            raise ValueError(f"a chunk table of {self.chunks} entries does not fit in 4 KiB")
        payload_stride = round_up(self.page_bytes, self.align)
        object.__setattr__(self, "header_stride", stride)
        object.__setattr__(self, "table_bytes", round_up(self.slots * stride, 4096))
        object.__setattr__(self, "payload_stride", payload_stride)
        object.__setattr__(self, "record_bytes", payload_stride + stride)
        if self.places and self.segment_bytes // PLACE_UNIT >= 1 << 32:
            raise ValueError("a segment of 2 TiB or more cannot record its payloads' places")

    @classmethod
    def plan(cls, page_bytes: int, segment_bytes: int, max_bytes: int | None) -> RecordLayout:
        """The layout for a new store: segments of about ``segment_bytes``, and small enough
        that the byte cap holds at least 16 of them (eviction frees one segment at a time, and
        each writing thread keeps one open)."""
        align = 4096 if page_bytes >= 64 << 10 else 512
        chunk = max(CHUNK_BYTES, round_up(-(-page_bytes // 500), 4096))  # table fits in 4 KiB
        probe = cls(page_bytes, align, 1, chunk)
        slots = max(1, segment_bytes // probe.record_bytes)
        if max_bytes:
            slots = max(1, min(slots, max_bytes // (16 * probe.record_bytes)))
        return cls(page_bytes, align, slots, chunk)

    def header_at(self, slot: int) -> int:
        """File offset of slot ``slot``'s header (and chunk table)."""
        return slot * self.header_stride

    def payload_at(self, slot: int) -> int:
        """File offset of slot ``slot``'s payload."""
        return self.table_bytes + slot * self.payload_stride

    def segment_slots_in(self, file_bytes: int) -> int:
        """Slots a segment file of ``file_bytes`` bytes has used (payloads written in order)."""
        return max(0, -(-(file_bytes - self.table_bytes) // self.payload_stride))

    @property
    def chunks(self) -> int:
        """Entries of the chunk table (0: a page of one chunk needs none)."""
        return 0 if self.page_bytes <= self.chunk_bytes else -(-self.page_bytes // self.chunk_bytes)

    @property
    def segment_bytes(self) -> int:
        return self.table_bytes + self.slots * self.payload_stride

    def place(self, slot: int) -> int:
        """What slot ``slot``'s header records as its payload's place (0: format 1)."""
        return self.payload_at(slot) // PLACE_UNIT if self.places else 0

    def _places(self, slot0: int, count: int) -> range:
        """The places the headers of slots ``slot0 ...`` record (payloads are evenly spaced)."""
        step = self.payload_stride // PLACE_UNIT if self.places else 0
        first = self.place(slot0)
        return range(first, first + count * step, step) if step else range(0, 0, 1)

    def _fixed(self, slot0: int, count: int) -> bytes:
        """Bytes 0..20 of the headers of slots ``slot0 ...`` as ``encode_header`` writes them."""
        pieces, slot, end = [], slot0, slot0 + count
        while slot < end:
            block, first = divmod(slot, _FIXED_SLOTS)
            take = min(end - slot, _FIXED_SLOTS - first)
            pieces.append(_fixed_block(self, block)[first * 20:(first + take) * 20])
            slot += take
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    # ---- encoding ----------------------------------------------------------------------
    def encode_header(self, slot: int, key: bytes, payload: memoryview) -> bytes:
        """Slot ``slot``'s header and chunk table for ``payload`` stored under ``key``."""
        table = b"".join(struct.pack("<Q", xxhash.xxh3_64_intdigest(payload[a:a + self.chunk_bytes]))
                         for a in range(0, self.page_bytes, self.chunk_bytes)) if self.chunks else b""
        return encode_header(key, payload, flags=self.place(slot)) + table

    def verify(self, prefix: memoryview | bytes | bytearray, slot: int, key: bytes, payload: memoryview,
               check_payload: bool = True) -> Verdict:
        """Check a record read back from slot ``slot``: header intact, right key, place and
        length, payload checksum (skipped when ``check_payload`` is False: header-only
        verification)."""
        magic, version, size, flags, length, digest, stored_key, crc = _HEADER.unpack_from(prefix)
        if magic != MAGIC or size != HEADER_BYTES or zlib.crc32(prefix[:60]) != crc:
            return Verdict.TORN
        if version != RECORD_VERSION or stored_key != key or flags != self.place(slot):
            return Verdict.FOREIGN
        if length != self.page_bytes:
            return Verdict.CORRUPT
        if check_payload and xxhash.xxh3_64_intdigest(payload) != digest:
            return Verdict.CORRUPT
        return Verdict.OK

    def verify_many(self, headers: bytes | bytearray, slot0: int, keys: Sequence[bytes],
                    payloads: Sequence[memoryview], check_payload: bool = True) -> list[bool]:
        """``verify`` of the consecutive slots ``slot0, slot0 + 1, ...`` at once (``headers``:
        their header-table entries back to back); True where the record is OK. The same checks,
        over the whole batch at once: every payload still gets its own ``xxh3``, every header its crc."""
        count, stride = len(keys), self.header_stride
        joined = b"".join(keys)
        if len(joined) != count * KEY_BYTES:  # a malformed key: no record can match it
            return [self.verify(memoryview(headers)[i * stride:(i + 1) * stride], slot0 + i,
                                keys[i], payloads[i], check_payload) is Verdict.OK
                    for i in range(count)]
        rows = np.frombuffer(headers, _header_fields(stride), count)
        digests = None
        if check_payload:
            digests = array("Q", map(xxhash.xxh3_64_intdigest, payloads))
            if _BIG_ENDIAN:
                digests.byteswap()
        # Fast path: every record as written, compared as bytes, a few calls per batch.
        if (rows["fixed"].tobytes() == self._fixed(slot0, count)
                and rows["key"].tobytes() == joined
                and (digests is None or rows["digest"].tobytes() == digests.tobytes())
                and _crcs_hold(rows["header"].tobytes(), count) is True):
            return [True] * count
        # Else field by field, to find which records fail.
        ok = rows["head"] == np.frombuffer(_HEAD_BYTES, "V8")
        places = self._places(slot0, count) if self.places else [0] * count
        ok &= rows["flags"] == np.fromiter(places, np.uint32, count)
        ok &= rows["length"] == np.frombuffer(struct.pack("<Q", self.page_bytes), "V8")
        ok &= rows["key"] == np.frombuffer(joined, _KEY_DTYPE)
        if digests is not None:
            ok &= rows["digest"] == np.frombuffer(digests.tobytes(), "V8")
        ok &= _crcs_hold(rows["header"].tobytes(), count)
        verdicts: list[bool] = ok.tolist()
        return verdicts

    def chunk_digest(self, prefix: memoryview | bytes | bytearray, chunk: int) -> int:
        """The stored checksum of chunk ``chunk`` (pages with a chunk table only)."""
        start = HEADER_BYTES + 8 * chunk
        digest: int = struct.unpack_from("<Q", prefix, start)[0]
        return digest


# ---------------------------------------------------------------------------------------------
# Manifest
# ---------------------------------------------------------------------------------------------


def load_or_create_manifest(root: Path, page_bytes: int, segment_bytes: int,
                            max_bytes: int | None) -> RecordLayout:
    """The layout recorded in ``root``'s manifest, creating it (atomically) for a new store.

    Raises ``StoreCorrupt`` for a directory that holds a store's journal or segments but no
    manifest (its layout is unknown, and guessing one would misread every record), and what
    ``read_manifest`` raises."""
    path = root / MANIFEST
    # The manifest is written before any other file of a store: files without it (looked for
    # again after seeing them, in case a concurrent creator just finished) mean it was lost.
    if not path.exists() and _holds_store_files(root) and not path.exists():
        raise StoreCorrupt(
            f"{root} holds a kvtier store's index or segments but no {MANIFEST}, so the layout "
            f"of its records is unknown; restore {MANIFEST} (or remove the directory to start "
            "an empty store)", identity(root))
    if not path.exists():
        layout = RecordLayout.plan(page_bytes, segment_bytes, max_bytes)
        body = {"format": FORMAT, "version": FORMAT_VERSION, **asdict(layout)}  # derived too
        tmp = root / f".{MANIFEST}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(body, indent=2) + "\n")
        try:
            os.link(tmp, path)  # atomic; loses to a concurrent creator, whose manifest we read
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    return read_manifest(root, page_bytes)


def read_manifest(root: Path, page_bytes: int | None = None) -> RecordLayout:
    """The layout of an existing store; ``page_bytes`` (when given) must match it.

    Raises ``StoreUnavailable`` when the manifest cannot be read (permissions, IO),
    ``StoreCorrupt`` when it is not a valid manifest (garbled JSON, missing fields), and
    ``LayoutMismatch`` for a store of another format, a newer version or another page size."""
    path = root / MANIFEST
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise StoreUnavailable(f"{path}: cannot read the store manifest ({exc})") from None
    try:
        body = json.loads(text)
        if not isinstance(body, dict):
            raise ValueError(f"a JSON {type(body).__name__}, not an object")
        if body.get("format") != FORMAT or body.get("version") not in (1, FORMAT_VERSION):
            raise LayoutMismatch(f"{path}: format {body.get('format')!r} "
                                 f"v{body.get('version')} is not {FORMAT} v{FORMAT_VERSION}; "
                                 "the directory is left untouched: give this store a "
                                 "directory of its own")
        layout = RecordLayout(int(body["page_bytes"]), int(body["align"]), int(body["slots"]),
                              int(body["chunk_bytes"]), places=body["version"] >= 2)
    except LayoutMismatch:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise StoreCorrupt(f"{path}: not a valid kvtier store manifest ({type(exc).__name__}: "
                           f"{exc})", identity(root)) from None
    if page_bytes is not None and layout.page_bytes != page_bytes:
        raise LayoutMismatch(f"{root} holds pages of {layout.page_bytes} bytes (another model, "
                             f"dtype or page size), not {page_bytes}; the directory is left "
                             "untouched: give this store a directory of its own")
    return layout


def _holds_store_files(root: Path) -> bool:
    """True if ``root`` has a journal, snapshot, ``HEAD`` or segment file (a store's data)."""
    if (root / "HEAD").exists() or any(root.glob("journal.*")) or any(root.glob("snapshot.*")):
        return True
    return bool(list_segments(root / "segments")) if (root / "segments").is_dir() else False


def segment_path(directory: Path, seg: int) -> Path:
    return directory / f"{seg:010d}{SEGMENT_SUFFIX}"


def list_segments(directory: Path) -> dict[int, int]:
    """Segment id -> file size for every segment file in ``directory`` (regular files only:
    a directory or other entry that merely has a segment's name is not one)."""
    found: dict[int, int] = {}
    with os.scandir(directory) as entries:
        for entry in entries:
            name = entry.name
            if name.endswith(SEGMENT_SUFFIX) and name[:-len(SEGMENT_SUFFIX)].isdigit():
                try:
                    if entry.is_file(follow_symlinks=False):
                        found[int(name[:-len(SEGMENT_SUFFIX)])] = entry.stat().st_size
                except FileNotFoundError:
                    continue  # evicted while we looked
    return found
