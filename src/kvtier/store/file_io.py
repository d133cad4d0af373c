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
        found = [False] * len(plans)
        corrupt = errors = 0
        for first, last in _runs(plans):
            try:
                if not self._read_run(plans, keys, views, first, last, found):
                    raise OSError(errno.EIO, "short read")  # a file shorter than its slots
            except OSError:
                try:  # again page by page, so that one bad slot fails only its own page
                    sub = self.each(plans[first:last], keys[first:last], views[first:last],
                                    self.read)
                except OSError:
                    errors += last - first
                    continue
                found[first:last] = sub[0]
                corrupt += sub[1]
                errors += sub[2]
                continue
            corrupt += (last - first) - sum(found[first:last])
        return found, corrupt, errors

    def _read_run(self, plans: Sequence[tuple[int, int] | None], keys: Sequence[bytes],
                  views: Sequence[memoryview], first: int, last: int, found: list[bool]) -> bool:
        """Read pages ``first..last`` (consecutive slots of one segment) with one ``preadv``
        for their headers and one for their payloads; False on a short read."""
        layout = self.layout
        fd, slot0 = plans[first]  # type: ignore[misc]
        count = last - first
        stride, page_bytes = layout.header_stride, layout.page_bytes
        headers = bytearray(count * stride)
        if os.preadv(fd, [headers], slot0 * stride) != len(headers):
            return False
        iovecs: list[memoryview] = []
        pad = layout.payload_stride - page_bytes
        for i in range(first, last):
            iovecs.append(views[i])
            if pad and i + 1 < last:
                iovecs.append(self._buffers()[0][:pad])
        want = count * page_bytes + (count - 1) * pad
        if _preadv_all(fd, iovecs, layout.payload_at(slot0)) != want:
            return False
        verify, check, heads = layout.verify, self.verify_payload, memoryview(headers)
        for n, i in enumerate(range(first, last)):
            header = heads[n * stride:(n + 1) * stride]
            found[i] = verify(header, keys[i], views[i], check) is Verdict.OK
        return True

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


#: Pages per coalesced read (each page is one iovec, two with padding; IOV_MAX is 1024).
MAX_RUN = 256


def _runs(plans: Sequence[tuple[int, int] | None]) -> list[tuple[int, int]]:
    """Spans ``[first, last)`` of plans that name consecutive slots of one segment."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, plan in enumerate(plans):
        if plan is None:
            if start is not None:
                runs.append((start, i))
                start = None
            continue
        prev = plans[i - 1] if i else None
        if start is not None and (prev is None or prev[0] != plan[0] or prev[1] + 1 != plan[1]
                                  or i - start >= MAX_RUN):
            runs.append((start, i))
            start = None
        if start is None:
            start = i
    if start is not None:
        runs.append((start, len(plans)))
    return runs


def _preadv_all(fd: int, iovecs: list[memoryview], offset: int) -> int:
    """``os.preadv`` that continues after a partial read; bytes read (short only at EOF)."""
    total = want = sum(v.nbytes for v in iovecs)
    got = os.preadv(fd, iovecs, offset)
    while got and got < want:  # the kernel may stop early (e.g. across a readahead window)
        done, rest = got, []
        for v in iovecs:
            if done >= v.nbytes:
                done -= v.nbytes
                continue
            rest.append(v[done:])
            done = 0
        offset, want, iovecs = offset + got, want - got, rest
        got = os.preadv(fd, iovecs, offset)
    return total - want + got if got < want else total
