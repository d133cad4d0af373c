"""Record IO of the ``file://`` store: one page in or out of a segment slot, verified.

Owns ``RecordIO``: whole-page reads (a run of records in adjacent slots of one segment is one
``preadv`` of their payloads straight into the caller's buffers and one of their headers, then
one batch verification: every payload's checksum, every header's fields and crc), record
writes (payloads, then headers, a run of adjacent slots at once; the journal entry that
publishes them comes after both), partial reads of byte ranges (only the chunks that hold
them, each checked against the slot's chunk table), and the O_DIRECT variants, which go through
page-aligned bounce buffers (one set per thread). Stateless apart from those buffers; called
concurrently from IO worker threads. ``os.preadv``/``pwritev`` release the GIL; the checksums
(python-xxhash's one-shot ``xxh3``) hold it up to 64 KiB, about 2 us per 64 KiB. Releasing it for
each page's checksum (a ctypes call of the same C function) measured slower with 4 threads on 2
cores: more GIL hand-offs (``benchmarks/probes/disk_read_threads.py``, variant ``records_ctypes``).
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import xxhash

from kvtier.layout import ByteRange
from kvtier.store.file.index import SLOT_BITS, SLOT_MASK
from kvtier.store.file.segment import RecordLayout
from kvtier.store.record import Verdict

if TYPE_CHECKING:
    from kvtier.store.file.segment_files import Slot

#: Above this share of a page, a partial read reads the whole page instead.
PARTIAL_READ_LIMIT = 0.75
_BLOCK = 4096


class RecordIO:
    """Reads and writes single records of one store layout."""

    def __init__(self, layout: RecordLayout, *, direct: bool, verify_payload: bool) -> None:
        self.layout = layout
        self.direct = direct
        self.verify_payload = verify_payload
        self.max_run = max(1, min(MAX_RUN, RUN_BYTES // layout.payload_stride))
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
    def read_many(self, locs: Sequence[int | None], fds: dict[int, int | None],
                  keys: Sequence[bytes], views: Sequence[memoryview]) -> tuple[list[bool], int, int]:
        """Read whole pages into ``views``: ``locs[i]`` is key ``i``'s record location
        (``seg << 32 | slot``; None: a miss) and ``fds`` a pinned descriptor per segment (None:
        gone). Returns (found, corrupt, IO errors). The hot path: each run of consecutive slots
        is one ``preadv`` for its headers and one for its payloads, verified together
        (``RecordLayout.verify_many``) while the payloads are still in cache."""
        if self.direct:
            return self.each(plans_of(locs, fds), keys, views, self.read)
        found = [False] * len(locs)
        corrupt = errors = 0
        for first, last in _runs(locs, fds, self.max_run):
            fd = fds[locs[first] >> SLOT_BITS]  # type: ignore[operator]
            slot0 = locs[first] & SLOT_MASK  # type: ignore[operator]
            try:
                ok = self._read_run(fd, slot0, keys[first:last], views[first:last])  # type: ignore[arg-type]
            except OSError:
                ok = None
            if ok is None:  # a short read or an IO error: again page by page, so that one bad
                # slot fails only its own page
                sub = self.each(plans_of(locs[first:last], fds), keys[first:last],
                                views[first:last], self.read)
                found[first:last] = sub[0]
                corrupt += sub[1]
                errors += sub[2]
                continue
            found[first:last] = ok
            corrupt += (last - first) - sum(ok)
        return found, corrupt, errors

    def _read_run(self, fd: int, slot0: int, keys: Sequence[bytes],
                  views: Sequence[memoryview]) -> list[bool] | None:
        """Read and verify the records in slots ``slot0, slot0 + 1, ...`` of one segment;
        None on a short read."""
        layout = self.layout
        count, stride = len(keys), layout.header_stride
        headers = bytearray(count * stride)
        if os.preadv(fd, [headers], slot0 * stride) != len(headers):
            return None
        pad = layout.payload_stride - layout.page_bytes
        if pad:
            gap = self._buffers()[0][:pad]
            iovecs = [v for view in views for v in (view, gap)][:-1]
        else:
            iovecs = list(views)
        want = count * layout.page_bytes + (count - 1) * pad
        if _preadv_all(fd, iovecs, layout.payload_at(slot0), want) != want:
            return None
        return layout.verify_many(headers, slot0, keys, views, self.verify_payload)

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
            verdict = layout.verify(header, slot, key, payload, self.verify_payload)
            if verdict is Verdict.OK:
                view[:] = payload
            return verdict
        if os.preadv(fd, [view], layout.payload_at(slot)) < layout.page_bytes:
            return Verdict.TORN
        header = self._header(fd, slot)
        if header is None:
            return Verdict.TORN
        return layout.verify(header, slot, key, view, self.verify_payload)

    def write(self, fd: int, direct_fd: int | None, slot: int, key: bytes,
              payload: memoryview) -> None:
        """Write the payload, then the header, of ``key``'s record into ``slot``; raises
        OSError if any byte failed. ``direct_fd``: an O_DIRECT descriptor for the payload."""
        layout = self.layout
        header = layout.encode_header(slot, key, payload)
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

    def write_run(self, fd: int, slot0: int, keys: Sequence[bytes],
                  payloads: Sequence[memoryview]) -> None:
        """``write`` of records into the consecutive slots ``slot0, slot0 + 1, ...`` (buffered
        IO only): one ``pwritev`` for their payloads, then one ``pwrite`` for their headers.
        Raises OSError if any byte failed (the caller then writes them one by one, to learn
        which)."""
        layout = self.layout
        count, stride = len(keys), layout.header_stride
        encode = layout.encode_header
        headers = b"".join([encode(slot0 + i, key, payload).ljust(stride, b"\0")
                            for i, (key, payload) in enumerate(zip(keys, payloads, strict=True))])
        pad = layout.payload_stride - layout.page_bytes
        if pad:
            gap = memoryview(bytes(pad))
            iovecs = [v for payload in payloads for v in (payload, gap)][:-1]
        else:
            iovecs = list(payloads)
        want = count * layout.page_bytes + (count - 1) * pad
        if (os.pwritev(fd, iovecs, layout.payload_at(slot0)) != want
                or os.pwrite(fd, headers, layout.header_at(slot0)) != len(headers)):
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
        verdict = layout.verify(header, slot, key, memoryview(b""), check_payload=False)
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
        verdict = layout.verify(header, slot, key, payload, self.verify_payload)
        if verdict is Verdict.OK:
            _pack(payload, ranges, out)
        return verdict


def _pack(payload: memoryview, ranges: Sequence[ByteRange], out: memoryview) -> None:
    pos = 0
    for r in ranges:
        out[pos:pos + r.length] = payload[r.offset:r.end]
        pos += r.length


#: Pages per coalesced read at most (each page is one iovec, two with padding; IOV_MAX is 1024),
#: and bytes per coalesced read at most: the run is verified right after it lands, while its
#: payloads are still in the CPU's cache (a checksum over bytes that already left the cache
#: costs about three times as much).
MAX_RUN = 256
RUN_BYTES = 2 << 20


def plans_of(locs: Sequence[int | None],
             fds: dict[int, int | None]) -> list[tuple[int, int] | None]:
    """(descriptor, slot) of each location (None: a miss or a segment that is gone)."""
    plans: list[tuple[int, int] | None] = []
    for loc in locs:
        fd = None if loc is None else fds.get(loc >> SLOT_BITS)
        plans.append(None if fd is None else (fd, loc & SLOT_MASK))  # type: ignore[operator]
    return plans


def _runs(locs: Sequence[int | None], fds: dict[int, int | None],
          max_run: int) -> list[tuple[int, int]]:
    """Spans ``[first, last)`` of readable locations that name consecutive slots of one
    segment (``seg << 32 | slot``: the next slot is the next integer), ``max_run`` at most."""
    runs: list[tuple[int, int]] = []
    start = prev = -1
    for i, loc in enumerate(locs):
        if start >= 0 and loc == prev + 1 and i - start < max_run:
            prev = loc
            continue
        if start >= 0:
            runs.append((start, i))
        if loc is None or fds.get(loc >> SLOT_BITS) is None:
            start = -1
        else:
            start, prev = i, loc
    if start >= 0:
        runs.append((start, len(locs)))
    return runs


def slot_runs(slots: Sequence[Slot], max_run: int) -> list[tuple[int, int]]:
    """Spans ``[first, last)`` of reserved slots (``segment_files.Slot``) that are consecutive
    in one segment, ``max_run`` at most."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if (i == len(slots) or i - start >= max_run or slots[i].seg != slots[i - 1].seg
                or slots[i].slot != slots[i - 1].slot + 1):
            runs.append((start, i))
            start = i
    return runs


def _preadv_all(fd: int, iovecs: list[memoryview], offset: int, want: int) -> int:
    """``os.preadv`` of ``want`` bytes that continues after a partial read; bytes read (short
    only at EOF)."""
    total = want
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
