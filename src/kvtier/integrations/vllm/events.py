"""KV events of kvtier's vLLM connector, as vLLM's own ``BlockStored`` objects.

Owns ``EventLog``: the worker half records each prompt it committed (``stored``), the scheduler
half hands them to vLLM in ``take_events`` (vLLM publishes them on its KV-event stream). A
record holds what any event format needs (page keys in prefix order, the parent key, the tokens,
the page size, the medium), and only ``_to_vllm`` builds vLLM's type, so a different publisher
can take the same records. Block hashes are kvtier's 32-byte page keys, which already name a
page's whole prefix and its tenant salt. Called from the model-runner thread (``stored``) and
the scheduling thread (``take``); a lock guards the list.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.keys import KeyNamespace, PageKey, page_keys

#: Medium named in the events: pages kvtier holds outside vLLM's own KV cache.
MEDIUM = "kvtier"


@dataclass(frozen=True)
class StoredPages:
    """Full pages of one prompt prefix that kvtier now holds."""

    keys: tuple[PageKey, ...]
    tokens: tuple[int, ...]
    page_size: int
    salt: str | None


class EventLog:
    """See the module docstring."""

    def __init__(self) -> None:
        self._records: list[StoredPages] = []
        self._lock = threading.Lock()

    def stored(self, namespace: KeyNamespace, tokens: Sequence[int], salt: str | None,
               page_size: int) -> None:
        keys = page_keys(list(tokens), page_size, namespace, salt)
        if keys:
            record = StoredPages(tuple(keys), tuple(tokens[: len(keys) * page_size]), page_size, salt)
            with self._lock:
                self._records.append(record)

    def take_records(self) -> list[StoredPages]:
        with self._lock:
            records, self._records = self._records, []
        return records

    def take(self) -> list[Any]:
        """vLLM ``BlockStored`` events of everything stored since the last call."""
        return [_to_vllm(record) for record in self.take_records()]


def _to_vllm(record: StoredPages) -> Any:
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(block_hashes=[bytes(k) for k in record.keys], parent_block_hash=None,
                       token_ids=list(record.tokens), block_size=record.page_size, lora_id=None,
                       medium=MEDIUM, lora_name=None,
                       extra_keys=[(record.salt,) if record.salt else None] * len(record.keys))
