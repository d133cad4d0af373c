"""KV events for one cache, as the server configures them: a recorder and, optionally, ZMQ.

Owns ``KVEventFeed``: ``KVEventFeed.from_config(config.server, index)`` attaches an
``EventRecorder`` to the index and starts a ``ZmqEventPublisher`` on ``kv_events_endpoint``
(None when the endpoint is empty: events off, the index keeps no observer and pays nothing).
Without an endpoint (``KVEventFeed.local(index)``) nothing is published and a caller such as a
vLLM connector drains the events itself with ``take()``. Built and closed on the thread that
owns the index (the engine thread at start-up); ``take`` and ``stats`` from any one thread.
"""

from __future__ import annotations

from typing import Any

from kvtier.events.publisher import ZmqEventPublisher
from kvtier.events.recorder import EventRecorder
from kvtier.events.types import KVEvent


class KVEventFeed:
    """An attached recorder, and the publisher draining it (None: ``take`` is for the caller)."""

    def __init__(self, recorder: EventRecorder, publisher: ZmqEventPublisher | None = None) -> None:
        self.recorder = recorder
        self.publisher = publisher

    @classmethod
    def from_config(cls, server: Any, index: Any) -> KVEventFeed | None:
        """The feed ``server`` (a ``ServerConfig``) asks for, or None when events are off."""
        if not server.kv_events_endpoint:
            return None
        recorder = EventRecorder(index, queue_events=server.kv_events_queue_events,
                                 block_size=server.kv_events_block_size)
        publisher = ZmqEventPublisher(recorder.take, server.kv_events_endpoint,
                                      topic=server.kv_events_topic,
                                      replay_endpoint=server.kv_events_replay_endpoint,
                                      buffer_batches=server.kv_events_buffer_batches)
        recorder.attach()
        return cls(recorder, publisher)

    @classmethod
    def local(cls, index: Any, *, queue_events: int = 100_000, block_size: int = 0) -> KVEventFeed:
        """Events kept for ``take()`` (no ZMQ): what a vLLM connector's ``take_events`` reads."""
        recorder = EventRecorder(index, queue_events=queue_events, block_size=block_size)
        return cls(recorder.attach())

    def take(self, limit: int | None = None) -> list[KVEvent]:
        if self.publisher is not None:
            raise RuntimeError("this feed's events go to its ZMQ publisher; take() would steal them")
        return self.recorder.take(limit)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"recorder": self.recorder.stats()}
        if self.publisher is not None:
            out["publisher"] = self.publisher.stats()
        return out

    def close(self) -> None:
        self.recorder.detach()
        if self.publisher is not None:
            self.publisher.close()
