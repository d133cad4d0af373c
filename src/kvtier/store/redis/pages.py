"""Reading a run of GET replies that are page records, many replies per system call.

Owns ``read_pages`` and ``page_views`` (the flat byte views of callers' page buffers). Over plain
TCP, the replies of pipelined GETs are received with vectored receives (``Channel.recv_scattered``)
into buffers laid out as the replies should arrive: per page, the framing (the previous reply's
CRLF and the ``$<size>`` line) into one small area, the record header into another, then the
payload into the caller's page buffer. One system call takes as many replies as the socket holds,
and payloads still arrive with only the kernel's copy. The framing area is checked against what
page replies send with one comparison per receive, partial frames included, so the reader never
waits for bytes the server does not owe: at the first reply that is not a record of the expected
size (a miss, an error, another length) the bytes received from its start on are handed back to the
``ReplyReader``, which parses that reply the general way (``ReplyReader.page``), and bulk reading
resumes once the reader holds nothing again. TLS sockets take the general path for every reply.
Runs on the IO worker thread that called the store; on any exception the connection's state is
unknown (the caller disconnects it).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.store.base import Buffer, readable_view, writable_view
from kvtier.store.redis.channel import MAX_VIEWS
from kvtier.store.redis.wire import ProtocolError, Reply, ReplyReader

_CRLF = b"\r\n"


def page_views(buffers: Sequence[Buffer], nbytes: int, *, writable: bool) -> list[memoryview]:
    """``writable_view`` / ``readable_view`` of each buffer, with a shortcut for the usual flat
    byte buffers (numpy uint8 rows, bytearrays); anything else, and every misfit, goes through
    those functions (which raise the errors)."""
    slow = writable_view if writable else readable_view
    views = []
    for buffer in buffers:
        try:
            view = memoryview(buffer)
        except TypeError:  # a torch tensor
            view = None
        if (view is None or view.nbytes != nbytes or view.format != "B" or view.ndim != 1
                or (writable and view.readonly) or not view.c_contiguous):
            view = slow(buffer, nbytes)
        views.append(view)
    return views


def read_pages(reader: ReplyReader, header_bytes: int, dests: Sequence[memoryview]) -> list[Reply]:
    """One GET reply per buffer of ``dests`` (all of one size): the record header (payload in
    the buffer), ``None`` (nil), the length of a value of another size, or a ``ServerError``."""
    replies: list[Reply] = []
    done, count = 0, len(dests)
    scatters = reader.channel.scatters
    while done < count:
        owed = reader.idle_owed() if scatters else None
        if owed is not None:
            taken = _scatter(reader, owed, header_bytes, dests[done:])
            replies += taken
            done += len(taken)
            if done == count:
                break
        replies.append(reader.page(header_bytes, dests[done]))
        done += 1
    return replies


class _Layout:
    """Where the bytes of ``count`` page replies land, as a periodic stream.

    Reply k is ``fixed`` (the previous reply's CRLF and this reply's ``$<size>`` line), then a
    record header, then the payload; the last reply's CRLF follows the last payload. Fixed bytes
    land in ``fixed_area`` (one run, checked with one comparison), headers in ``header_area``,
    payloads in their page buffers. The first reply's ``fixed`` lacks the ``skip`` bytes of the
    CRLF that were already consumed; stream offsets here count from the full first ``fixed``.
    """

    def __init__(self, fixed: bytes, header_bytes: int, dests: Sequence[memoryview],
                 skip: int) -> None:  # dests: all of one size
        count, size = len(dests), len(dests[0])
        self.count, self.skip, self.header_bytes = count, skip, header_bytes
        self.fixed_bytes = flen = len(fixed)
        self.period = flen + header_bytes + size
        self.end = count * self.period + len(_CRLF)  # stream offset after the last CRLF
        self.expected = (fixed * count + _CRLF)[skip:]
        self.fixed_area = bytearray(len(self.expected))
        self.header_area = bytearray(count * header_bytes)
        fixed_view, header_view = memoryview(self.fixed_area), memoryview(self.header_area)
        fixed_views = [fixed_view[k * flen - skip:(k + 1) * flen - skip] for k in range(count + 1)]
        fixed_views[0] = fixed_view[:flen - skip]
        fixed_views[count] = fixed_view[count * flen - skip:]  # the last CRLF
        header_views = [header_view[k * header_bytes:(k + 1) * header_bytes] for k in range(count)]
        trios = zip(fixed_views[:count], header_views, dests, strict=True)
        views = [view for trio in trios for view in trio]
        views.append(fixed_views[count])
        self.views = views

    def locate(self, offset: int) -> tuple[int, int]:
        """(index in ``views``, offset in that view) of stream ``offset``."""
        k, r = divmod(offset, self.period)
        if r < self.fixed_bytes:
            return 3 * k, r - self.skip if k == 0 else r
        r -= self.fixed_bytes
        if r < self.header_bytes:
            return 3 * k + 1, r
        return 3 * k + 2, r - self.header_bytes

    def fixed_seen(self, offset: int) -> int:
        """Bytes of ``fixed_area`` filled once the stream up to ``offset`` arrived."""
        k, r = divmod(offset, self.period)
        return k * self.fixed_bytes + min(r, self.fixed_bytes) - self.skip

    def stream(self, begin: int, end: int) -> bytes:
        """Stream bytes ``begin:end`` as they landed."""
        pieces: list[bytes] = []
        while begin < end:
            index, at = self.locate(begin)
            view = self.views[index]
            piece = view[at:at + min(len(view) - at, end - begin)]
            pieces.append(bytes(piece))
            begin += len(piece)
        return b"".join(pieces)

    def headers(self, count: int) -> list[bytes]:
        """The record headers of the first ``count`` replies."""
        area, size = bytes(self.header_area[:count * self.header_bytes]), self.header_bytes
        return [area[k * size:(k + 1) * size] for k in range(count)]


def _scatter(reader: ReplyReader, owed: int, header_bytes: int,
             dests: Sequence[memoryview]) -> list[bytes]:
    """The headers of the leading replies of ``dests`` that are records of the expected size,
    read in bulk; stops at the first other reply, leaving its bytes with ``reader``."""
    line = b"$%d\r\n" % (header_bytes + len(dests[0]))
    skip = len(_CRLF) - owed
    lay = _Layout(_CRLF + line, header_bytes, dests, skip)
    views, expected, fixed_area = lay.views, lay.expected, lay.fixed_area
    recv = reader.channel.recv_scattered
    arrived, checked = skip, 0  # stream offset received up to; fixed bytes checked
    while arrived < lay.end:
        index, at = lay.locate(arrived)
        batch = views[index:index + MAX_VIEWS]
        if at:
            batch[0] = batch[0][at:]
        arrived += recv(batch)
        seen = lay.fixed_seen(arrived)
        if fixed_area[checked:seen] != expected[checked:seen]:
            bad = next(i for i in range(checked, seen) if fixed_area[i] != expected[i])
            reply, at = divmod(bad + skip, lay.fixed_bytes)
            if at < len(_CRLF):
                raise ProtocolError("bulk reply not terminated by CRLF")
            begin = reply * lay.period + len(_CRLF)  # where the odd reply starts
            reader.resume(lay.stream(begin, arrived))
            return lay.headers(reply)
        checked = seen
    reader.resume(b"")
    return lay.headers(lay.count)
