"""KV events of kvtier's vLLM connector: kvtier's own event stream, as vLLM's event classes.

Owns ``ConnectorEvents``. It attaches kvtier's ``events.EventRecorder`` to the cache's radix
index, the observer ``kvtier serve`` publishes from, so the events vLLM publishes for the
connector (``take_events``) say what ``kvtier serve``'s stream says, in the same form: a page
stored on or removed from each tier, with that tier's ``medium`` (``GPU`` for kvtier's device
pages, ``CPU`` for its host tier, ``STORAGE`` for disk and Redis, told apart by ``locality``
where vLLM's event class has the field) and block hashes that are the last 8 bytes of kvtier's
SHA-256 page keys (vLLM's integer block-hash rule), chained through ``parent_block_hash``,
cut into blocks of vLLM's block size. ``to_vllm`` builds vLLM's ``BlockStored``,
``BlockRemoved`` and ``AllBlocksCleared`` field by field from what the running vLLM's classes
declare, so every supported version gets the fields it knows.

A page announced on ``STORAGE`` is served as a hit once the store-only part of a prompt's match
reaches ``controller.min_prefetch_tokens`` (shorter store-only tails are recomputed: a read for
them would cost more than it saves); the README tells routers how to score them.

The recorder runs on whichever thread moves pages in the index (under the runtime's lock:
vLLM's scheduling loop, the model runner, kvtier's saver), O(1) each; ``take`` runs on vLLM's
scheduling loop and does the hashing and conversion.
"""

from __future__ import annotations

from typing import Any

from kvtier.events import types as kv
from kvtier.events.recorder import EventRecorder


class ConnectorEvents:
    """Records the cache index's tier moves; ``take()`` returns them as vLLM events."""

    def __init__(self, index: Any, block_size: int) -> None:
        self.recorder = EventRecorder(index, block_size=block_size).attach()

    def take(self) -> list[Any]:
        return [to_vllm(event) for event in self.recorder.take()]

    def close(self) -> None:
        self.recorder.detach()


def to_vllm(event: kv.KVEvent) -> Any:
    """vLLM's own event object for one of kvtier's (fields vLLM's class does not declare, such
    as ``locality`` before vLLM added it, are left out)."""
    from vllm.distributed import kv_events

    cls = getattr(kv_events, type(event).__name__)
    known = set(getattr(cls, "__struct_fields__", ()))
    fields = {name: getattr(event, name) for name in getattr(event, "__slots__", ())
              if name in known}
    return cls(**fields)
