"""Record IO of the ``file://`` store: one page in or out of a segment slot, verified.

Owns ``RecordIO``: whole-page reads (the payload straight into the caller's buffer with one
``preadv``, the slot's header with another, then verification), record writes (payload, then
header; the journal entry that publishes them comes after both), partial reads of byte ranges
(only the chunks that hold them, each checked against the slot's chunk table), and the O_DIRECT
variants, which go through page-aligned bounce buffers (one set per thread). Stateless apart
from those buffers; called concurrently from IO worker threads (``os.preadv``/``pwritev``
release the GIL).
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Callable, Sequence

import xxhash

from kvtier.layout import ByteRange
from kvtier.store.record import Verdict
from kvtier.store.segment import RecordLayout

#: Above this share of a page, a partial read reads the whole page instead.
PARTIAL_READ_LIMIT = 0.75
_BLOCK = 4096


class RecordIO:
    """Reads and writes single records of one store layout."""

    def __init__(self, layout: RecordLayout, *, direct: bool, verify_payload: bool) -> None:
        self.layout = layout
        self.direct = direct
        self.verify_payload = verify_payload
        self._local = threading.local()

    def _buffers(self) -> tuple[memoryview, memoryview]:
        """This thread's page-aligned (payload, header block) buffers."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = (memoryview(mmap.mmap(-1, self.layout.payload_stride)),
                                       memoryview(mmap.mmap(-1, _BLOCK)))
        return bufs

    def _header(self, fd: int, slot: int) -> memoryview | bytearray | None:
        """Slot ``slot``'s header and chunk table, or None if the file ends before it."""
        layout = self.layout
        at = layout.header_at(slot)
        if self.direct:  # O_DIRECT: read the aligned 4 KiB block that holds it
            block = self._buffers()[1]
            start = at - at % _BLOCK
            if os.preadv(fd, [block], start) < at - start + layout.header_stride:
                return None
            return block[at - start:at - start + layout.header_stride]
        header = bytearray(layout.header_stride)
        return header if os.preadv(fd, [header], at) == layout.header_stride else None

    # ---- batches -------------------------------------------------------------------------
    def read_many(self, plans: Sequence[tuple[int, int] | None], keys: Sequence[bytes],
                  views: Sequence[memoryview]) -> tuple[list[bool], int, int]:
        """Read whole pages (plan: descriptor and slot; None: a miss) into ``views``;
        (found, corrupt, IO errors). The hot path: one tight loop, two ``preadv`` per page."""
        if self.direct:
            return self.each(plans, keys, views, self.read)
        layout = self.layout
        stride, table, page_bytes = layout.header_stride, layout.table_bytes, layout.page_bytes
        payload_stride = layout.payload_stride
        verify, check_payload, preadv = layout.verify, self.verify_payload, os.preadv
        found = [False] * len(plans)
        corrupt = errors = 0
        for i, plan in enumerate(plans):
            if plan is None:
                continue
            fd, slot = plan
            header = bytearray(stride)
            view = views[i]
            try:
                ok = preadv(fd, [view], table + slot * payload_stride) == page_bytes and \
                    preadv(fd, [header], slot * stride) == stride
            except OSError:
                errors += 1
                continue
            if ok and verify(header, keys[i], view, check_payload) is Verdict.OK:
                found[i] = True
            else:
                corrupt += 1
        return found, corrupt, errors

    def each(self, plans: Sequence[tuple[int, int] | None], keys: Sequence[bytes],
             views: Sequence[memoryview],
             one: Callable[[int, int, bytes, memoryview], Verdict]) -> tuple[list[bool], int, int]:
        """Like ``read_many`` with ``one(fd, slot, key, view)`` doing each record."""
        found = [False] * len(plans)
        corrupt = errors = 0
        for i, plan in enumerate(plans):
            if plan is None:
                continue
            try:
                found[i] = one(plan[0], plan[1], keys[i], views[i]) is Verdict.OK
            except OSError:
                errors += 1
                continue
            corrupt += not found[i]
        return found, corrupt, errors

    # ---- whole records -------------------------------------------------------------------
    def read(self, fd: int, slot: int, key: bytes, view: memoryview) -> Verdict:
        """Read the page in ``slot`` into ``view`` and verify it; raises OSError on IO errors."""
        layout = self.layout
        if self.direct:
            bounce = self._buffers()[0]
            if os.preadv(fd, [bounce], layout.payload_at(slot)) < layout.page_bytes:
                return Verdict.TORN
            payload = bounce[:layout.page_bytes]
            header = self._header(fd, slot)
            if header is None:
                return Verdict.TORN
            verdict = layout.verify(header, key, payload, self.verify_payload)
            if verdict is Verdict.OK:
                view[:] = payload
            return verdict
        if os.preadv(fd, [view], layout.payload_at(slot)) < layout.page_bytes:
            return Verdict.TORN
        header = self._header(fd, slot)
        if header is None:
            return Verdict.TORN
        return layout.verify(header, key, view, self.verify_payload)

    def write(self, fd: int, direct_fd: int | None, slot: int, key: bytes,
              payload: memoryview) -> None:
        """Write the payload, then the header, of ``key``'s record into ``slot``; raises
        OSError if any byte failed. ``direct_fd``: an O_DIRECT descriptor for the payload."""
        layout = self.layout
        header = layout.encode_header(key, payload)
        if direct_fd is not None:
            bounce = self._buffers()[0]
            bounce[:layout.page_bytes] = payload
            written = os.pwritev(direct_fd, [bounce], layout.payload_at(slot))
            want = layout.payload_stride
        else:
            written = os.pwritev(fd, [payload], layout.payload_at(slot))
            want = layout.page_bytes
        if written != want or os.pwrite(fd, header, layout.header_at(slot)) != len(header):
            raise OSError(errno.ENOSPC, "short record write")

    # ---- partial reads -------------------------------------------------------------------
    def chunk_cover(self, ranges: Sequence[ByteRange]) -> list[tuple[int, int]] | None:
        """Runs of chunks ``[first, last)`` holding ``ranges``; None when a whole read is
        cheaper (a page of one chunk, ranges spread over most of the page, or O_DIRECT, which
        reads whole aligned payloads)."""
        layout = self.layout
        for r in ranges:
            if r.offset < 0 or r.length < 0 or r.end > layout.page_bytes:
                raise ValueError(f"range {r} is outside a page of {layout.page_bytes} bytes")
        if not layout.chunks or self.direct:
            return None
        wanted = sorted({c for r in ranges if r.length
                         for c in range(r.offset // layout.chunk_bytes,
                                        (r.end - 1) // layout.chunk_bytes + 1)})
        if len(wanted) > PARTIAL_READ_LIMIT * layout.chunks:
            return None
        runs: list[tuple[int, int]] = []
        for c in wanted:
            if runs and runs[-1][1] == c:
                runs[-1] = (runs[-1][0], c + 1)
            else:
                runs.append((c, c + 1))
        return runs

    def read_chunks(self, fd: int, slot: int, key: bytes, runs: list[tuple[int, int]],
                    ranges: Sequence[ByteRange], out: memoryview) -> Verdict:
        """Read only the chunks in ``runs``, verify each, and pack ``ranges`` into ``out``."""
        layout, chunk = self.layout, self.layout.chunk_bytes
        header = self._header(fd, slot)
        if header is None:
            return Verdict.TORN
        verdict = layout.verify(header, key, memoryview(b""), check_payload=False)
        if verdict is not Verdict.OK:
            return verdict
        payload = self._buffers()[0][:layout.page_bytes]
        base = layout.payload_at(slot)
        for first, last in runs:
            start, end = first * chunk, min(last * chunk, layout.page_bytes)
            if os.preadv(fd, [payload[start:end]], base + start) < end - start:
                return Verdict.TORN
            for c in range(first, last):
                piece = payload[c * chunk:min((c + 1) * chunk, layout.page_bytes)]
                if xxhash.xxh3_64_intdigest(piece) != layout.chunk_digest(header, c):
                    return Verdict.CORRUPT
        _pack(payload, ranges, out)
        return Verdict.OK

    def read_whole_then_pack(self, fd: int, slot: int, key: bytes,
                             ranges: Sequence[ByteRange], out: memoryview) -> Verdict:
        """Read and verify the whole page into scratch, then pack ``ranges`` into ``out``."""
        layout = self.layout
        scratch = self._buffers()[0]
        span = layout.payload_stride if self.direct else layout.page_bytes
        if os.preadv(fd, [scratch[:span]], layout.payload_at(slot)) < layout.page_bytes:
            return Verdict.TORN
        header = self._header(fd, slot)
        if header is None:
            return Verdict.TORN
        payload = scratch[:layout.page_bytes]
        verdict = layout.verify(header, key, payload, self.verify_payload)
        if verdict is Verdict.OK:
            _pack(payload, ranges, out)
        return verdict


def _pack(payload: memoryview, ranges: Sequence[ByteRange], out: memoryview) -> None:
    pos = 0
    for r in ranges:
        out[pos:pos + r.length] = payload[r.offset:r.end]
        pos += r.length
