"""Record IO of the ``file://`` store: one page in or out of a segment slot, verified.

Owns ``RecordIO``: whole-record reads (one ``preadv`` of header + payload straight into the
caller's buffer, then verification), record writes (one ``pwritev`` of header + payload from
the caller's buffer), partial reads of byte ranges (only the 64 KiB chunks that hold them, each
checked against the record's chunk table), and the O_DIRECT variants that go through a
page-aligned bounce buffer per thread. Stateless apart from those buffers; called concurrently
from IO worker threads (``os.preadv``/``pwritev`` release the GIL).
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


class RecordIO:
    """Reads and writes single records of one store layout."""

    def __init__(self, layout: RecordLayout, *, direct: bool, verify_payload: bool) -> None:
        self.layout = layout
        self.direct = direct
        self.verify_payload = verify_payload
        self._local = threading.local()

    def _bounce(self) -> memoryview:
        """This thread's page-aligned buffer of one record (for O_DIRECT and partial reads)."""
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = memoryview(mmap.mmap(-1, self.layout.record_bytes))
        return buf

    # ---- batches -------------------------------------------------------------------------
    def read_many(self, plans: Sequence[tuple[int, int] | None], keys: Sequence[bytes],
                  views: Sequence[memoryview]) -> tuple[list[bool], int, int]:
        """Read whole records (plan: descriptor and slot; None: a miss) into ``views``;
        (found, corrupt, IO errors). The hot path: one tight loop, one ``preadv`` per page."""
        if self.direct:
            return self.each(plans, keys, views, self.read)
        layout = self.layout
        prefix_bytes, record_bytes = layout.payload_offset, layout.record_bytes
        want = prefix_bytes + layout.page_bytes
        verify, check_payload, preadv = layout.verify, self.verify_payload, os.preadv
        found = [False] * len(plans)
        corrupt = errors = 0
        for i, plan in enumerate(plans):
            if plan is None:
                continue
            prefix = bytearray(prefix_bytes)
            try:
                got = preadv(plan[0], [prefix, views[i]], plan[1] * record_bytes)
            except OSError:
                errors += 1
                continue
            if got == want and verify(prefix, keys[i], views[i], check_payload) is Verdict.OK:
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
        """Read the record in ``slot`` into ``view``; raises OSError on an IO error."""
        layout = self.layout
        offset = layout.offset(slot)
        if self.direct:
            bounce = self._bounce()
            got = os.preadv(fd, [bounce], offset)
            if got < layout.payload_offset + layout.page_bytes:
                return Verdict.TORN
            payload = bounce[layout.payload_offset:layout.payload_offset + layout.page_bytes]
            verdict = layout.verify(bounce, key, payload, self.verify_payload)
            if verdict is Verdict.OK:
                view[:] = payload
            return verdict
        prefix = bytearray(layout.payload_offset)
        if os.preadv(fd, [prefix, view], offset) < layout.payload_offset + layout.page_bytes:
            return Verdict.TORN
        return layout.verify(prefix, key, view, self.verify_payload)

    def write(self, fd: int, slot: int, key: bytes, payload: memoryview) -> None:
        """Write a complete record for ``key`` into ``slot``; raises OSError if any byte failed."""
        layout = self.layout
        prefix = layout.encode_prefix(key, payload)
        if self.direct:
            bounce = self._bounce()
            bounce[:layout.payload_offset] = prefix
            bounce[layout.payload_offset:layout.payload_offset + layout.page_bytes] = payload
            parts: list[memoryview | bytes] = [bounce]
        else:
            parts = [prefix, payload]
        want = sum(memoryview(p).nbytes for p in parts)
        if os.pwritev(fd, parts, layout.offset(slot)) != want:
            raise OSError(errno.ENOSPC, "short record write")

    # ---- partial reads -------------------------------------------------------------------
    def chunk_cover(self, ranges: Sequence[ByteRange]) -> list[tuple[int, int]] | None:
        """Runs of chunks ``[first, last)`` holding ``ranges``; None when a whole read is
        cheaper (a page of one chunk, ranges spread over most of the page, or O_DIRECT, which
        reads whole aligned records)."""
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
        base = layout.offset(slot)
        scratch = self._bounce()
        prefix = scratch[:layout.payload_offset]
        if os.preadv(fd, [prefix], base) < layout.payload_offset:
            return Verdict.TORN
        verdict = layout.verify(prefix, key, memoryview(b""), check_payload=False)
        if verdict is not Verdict.OK:
            return verdict
        payload = scratch[layout.payload_offset:layout.payload_offset + layout.page_bytes]
        for first, last in runs:
            start, end = first * chunk, min(last * chunk, layout.page_bytes)
            if os.preadv(fd, [payload[start:end]], base + layout.payload_offset + start) < end - start:
                return Verdict.TORN
            for c in range(first, last):
                piece = payload[c * chunk:min((c + 1) * chunk, layout.page_bytes)]
                if xxhash.xxh3_64_intdigest(piece) != layout.chunk_digest(prefix, c):
                    return Verdict.CORRUPT
        pos = 0
        for r in ranges:
            out[pos:pos + r.length] = payload[r.offset:r.end]
            pos += r.length
        return Verdict.OK

    def read_whole_then_pack(self, fd: int, slot: int, key: bytes,
                             ranges: Sequence[ByteRange], out: memoryview) -> Verdict:
        """Read and verify the whole page into scratch, then pack ``ranges`` into ``out``."""
        layout = self.layout
        scratch = self._bounce()
        span = layout.record_bytes if self.direct else layout.payload_offset + layout.page_bytes
        got = os.preadv(fd, [scratch[:span]], layout.offset(slot))
        if got < layout.payload_offset + layout.page_bytes:
            return Verdict.TORN
        payload = scratch[layout.payload_offset:layout.payload_offset + layout.page_bytes]
        verdict = layout.verify(scratch, key, payload, self.verify_payload)
        if verdict is Verdict.OK:
            pos = 0
            for r in ranges:
                out[pos:pos + r.length] = payload[r.offset:r.end]
                pos += r.length
        return verdict

