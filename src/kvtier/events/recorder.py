"""The index's residency observer: records every tier move as a KV event, in order.

Owns ``EventRecorder``. Attached to a ``RadixIndex`` (``index.observer``), it runs on the engine
thread inside the index's residency transitions and does O(1) work there: one tuple holding
references to the run's immutable token and key bytes goes into a ``DropOldestQueue``. Hashes,
token lists and event objects are made later by whoever calls ``take`` (the ZMQ publisher
thread, or a vLLM connector's ``take_events``), so events cost the engine almost nothing.

What it records: a run stored on a tier (``BlockStored`` with the run's full token ids, so a
page promoted from disk to host is described completely even to a router that never saw it on
the device), a run leaving a tier (``BlockRemoved``: eviction, a store losing a page, a detach),
and, after ``clear_tiers`` (flush, a store's clear or detach) or on attach, ``AllBlocksCleared``
followed by a ``BlockStored`` for every run still indexed on every tier, so a subscriber that
applies the stream holds exactly the index's view. After the queue dropped events (counted), the
same restatement repairs subscribers at the first transition that finds the consumer caught up.
"""

from __future__ import annotations

from typing import Any

from kvtier.events.blocks import BlockNamer
from kvtier.events.queue import DropOldestQueue
from kvtier.events.types import TIER_PLACEMENT, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvtier.index.residency import TIERS, Node
from kvtier.keys import KEY_BYTES

_STORED, _REMOVED, _CLEARED = 0, 1, 2
_PLACEMENT = tuple(TIER_PLACEMENT[tier] for tier in TIERS)


class EventRecorder:
    """``EventRecorder(index, queue_events=100_000, block_size=0)``; ``attach()`` starts it."""

    def __init__(self, index: Any, *, queue_events: int = 100_000, block_size: int = 0) -> None:
        self.index = index
        self.namer = BlockNamer(index.page_size, block_size)
        self.queue = DropOldestQueue(queue_events)
        self.paused = False
        self.unnamed_pages = 0
        self.repairs = 0
        self._repaired_drops = 0

    # ---- engine thread ---------------------------------------------------------------------
    def attach(self) -> EventRecorder:
        """Observe the index from now on, announcing what it already holds."""
        if self.index.observer is not None and self.index.observer is not self:
            raise ValueError("the index already has a residency observer")
        self.index.observer = self
        self.cleared(self.index)
        return self

    def detach(self) -> None:
        if self.index.observer is self:
            self.index.observer = None

    def stored(self, node: Node, t: int) -> None:
        if self.queue.dropped != self._repaired_drops and self._repair():
            return
        keys = node.keys
        if not keys:  # a bookkeeping-only index without keys: nothing to name the pages by
            self.unnamed_pages += node.pages
            return
        parent = node.parent
        parent_key = parent.keys[-KEY_BYTES:] if parent is not None and parent.keys else None
        self.queue.put((_STORED, t, node.tokens, keys, parent_key))

    def removed(self, node: Node, t: int) -> None:
        if self.queue.dropped != self._repaired_drops and self._repair():
            return
        if node.keys:
            self.queue.put((_REMOVED, t, node.keys))

    def cleared(self, index: Any) -> None:
        queue = self.queue
        before = queue.dropped
        queue.put((_CLEARED,))
        for node in index.iter_nodes():  # parents first, so every parent is announced before
            for t, value in enumerate(node.res):
                if value is not None:
                    self.stored(node, t)
        if queue.dropped == before:  # a complete restatement also repairs earlier drops
            self._repaired_drops = queue.dropped

    def _repair(self) -> bool:
        """Events were dropped: once the consumer has caught up (the queue is empty) and the
        index's runs fit in half the queue, restate everything (it includes the transition
        that called). True if it did."""
        queue = self.queue
        resident = sum(ledger.resident for ledger in self.index.ledgers)
        if len(queue) or resident + 1 > queue.capacity // 2:
            return False
        self._repaired_drops = queue.dropped
        self.repairs += 1
        self.cleared(self.index)
        return True

    # ---- any one consumer thread ---------------------------------------------------------------
    def take(self, limit: int | None = None) -> list[KVEvent]:
        """The pending events (up to ``limit``), oldest first, as plain objects."""
        return [self._event(record) for record in self.queue.take(limit)]

    def _event(self, record: tuple[Any, ...]) -> KVEvent:
        kind = record[0]
        if kind == _CLEARED:
            return AllBlocksCleared()
        medium, locality = _PLACEMENT[record[1]]
        namer = self.namer
        if kind == _REMOVED:
            return BlockRemoved(namer.hashes(record[2]), medium, locality)
        _, _, tokens, keys, parent_key = record
        return BlockStored(namer.hashes(keys), namer.parent_hash(parent_key),
                           namer.token_ids(tokens), namer.block_size, None, medium, None,
                           locality)

    def stats(self) -> dict[str, int]:
        return {**self.queue.stats(), "unnamed_pages_total": self.unnamed_pages,
                "repairs_total": self.repairs}
