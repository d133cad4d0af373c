"""The run marker of a Redis page store: how kvtier notices a server that lost its pages.

Owns ``RunMarker``. The key ``kvtier-run@<prefix>`` holds a random token (outside the page
prefix, so an exact page count by ``SCAN <prefix>*`` does not see it): every check offers a new
random token with ``SET NX`` (taken only where the key is missing) and reads the key back, and
every store remembers the token it last read. A server that
restarted empty, or was flushed, no longer holds it, so the next check finds another token
(written by whichever store checked first) and reports the pages lost: the cache then drops
what its index believed the remote tier holds at once, instead of serving misses for it and
writing its pages again only a pass later. Checked when the store opens and on every health
probe (the store guard's thread, every few seconds), which also keeps the key recently used so
an LRU server does not evict it ahead of pages. With Redis Cluster the key lives on the one
primary that owns its slot, so only that primary's restart is seen this way (pages on another
primary that restarted read as misses, which the cache also forgets, one request later).
"""

from __future__ import annotations

import os
import threading

from kvtier.store.redis.channel import Channel, Deadline
from kvtier.store.redis.endpoint import Endpoint, Work
from kvtier.store.redis.wire import Reply, ReplyReader, ServerError, pack

MARKER = b"kvtier-run@"  # + the store's prefix: one marker per namespace of pages


def mark(rkey: bytes, token: bytes) -> Work[Reply]:
    """``SET rkey token NX`` then ``GET rkey``, pipelined; returns the token the key holds."""

    def work(channel: Channel, reader: ReplyReader) -> Reply:
        channel.send([pack(b"SET", rkey, token, b"NX") + pack(b"GET", rkey)])
        replies = [reader.simple(), reader.simple()]
        for reply in replies:
            if isinstance(reply, ServerError):
                raise reply
        return replies[1]

    return work


class RunMarker:
    """See the module docstring."""

    def __init__(self, prefix: bytes) -> None:
        self.rkey = MARKER + prefix
        self._seen: Reply = None
        self._lock = threading.Lock()

    def check(self, endpoint: Endpoint, timeout_s: float) -> bool:
        """True if the key holds another token than at the last check (the server lost its
        pages since); the first check only notes it. Raises ``EndpointDown``."""
        offer = os.urandom(16).hex().encode()  # new each time: a key set again differs
        seen = endpoint.run(mark(self.rkey, offer), Deadline(timeout_s))
        with self._lock:
            last, self._seen = self._seen, seen
        return last is not None and seen != last
