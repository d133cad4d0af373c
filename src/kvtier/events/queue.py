"""A bounded hand-off queue between the engine thread and an event consumer, dropping the oldest.

Owns ``DropOldestQueue``. One producer (the engine thread) calls ``put``; any one consumer
thread (the ZMQ publisher, or a connector's ``take_events``) calls ``take``. Neither waits on
the other: both are O(1) deque operations, atomic under the GIL, with no lock. When the queue
is full, ``put`` removes the oldest item first and counts it in ``dropped``; a drop is counted
only when the producer itself removed an item, so the count is exact even while the consumer
empties the queue at the same moment.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from kvtier.errors import ConfigError


class DropOldestQueue:
    """At most ``capacity`` items; ``put`` never blocks, ``take`` returns the oldest first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ConfigError("server.kv_events_queue_events", capacity, "an integer >= 1")
        self.capacity = capacity
        self._items: deque[Any] = deque()
        self.put_total = 0
        self.dropped = 0

    def put(self, item: Any) -> None:
        items = self._items
        if len(items) >= self.capacity:
            try:
                items.popleft()
                self.dropped += 1
            except IndexError:  # the consumer emptied it meanwhile: nothing was lost
                pass
        items.append(item)
        self.put_total += 1

    def take(self, limit: int | None = None) -> list[Any]:
        """Up to ``limit`` items (all when None), oldest first."""
        items = self._items
        n = len(items) if limit is None else min(limit, len(items))
        out = []
        for _ in range(n):
            try:
                out.append(items.popleft())
            except IndexError:
                break
        return out

    def __len__(self) -> int:
        return len(self._items)

    def stats(self) -> dict[str, int]:
        return {"queued": len(self._items), "put_total": self.put_total,
                "dropped_total": self.dropped, "capacity": self.capacity}
