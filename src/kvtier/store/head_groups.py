"""``HeadGroupStore``: a rank's view of a store shared by tensor-parallel ranks of any size.

A stored record is written whole by one writer (its header carries the payload's checksum), and
a rank holds only its share of the KV heads, so a page cannot be stored as one record by several
ranks. Instead a page is stored as one record per *head group* (``heads_per_record`` consecutive
KV heads of the model, in the group's canonical order ``[layers, K|V, page_size, group heads,
head_dim]``), each under a key derived from the page key and the group's head range
(``heads=4-5/8``). A rank of any tensor-parallel size whose heads are whole groups then writes
its groups and reads its groups, whatever size of world wrote them: a TP=2 rank writes groups
0-3, a TP=4 rank reads groups 2-3 of them, a TP=1 process reads all 8.

Owns the group keys and the gather/scatter between a rank's page (``KVLayout.for_heads``) and its
group records; the inner store holds the records (its ``page_bytes`` is one group's page). A page
is present only when all of the rank's groups are. Called from IO worker threads, like any store.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvtier.errors import ConfigError
from kvtier.layout import KVLayout
from kvtier.store.base import Buffer, PageStore, StoreStats, readable_view, writable_view


def group_layout(layout: KVLayout, heads_per_record: int) -> KVLayout:
    """The layout of one record: ``heads_per_record`` KV heads of ``layout``."""
    if heads_per_record < 1 or layout.num_kv_heads % heads_per_record:
        raise ConfigError("heads_per_record", heads_per_record,
                          f"a divisor of the model's {layout.num_kv_heads} KV heads")
    return layout.for_heads((0, heads_per_record))


def check_heads(layout: KVLayout, heads: tuple[int, int], heads_per_record: int) -> KVLayout:
    """The record layout, once ``heads`` is known to be whole groups of ``heads_per_record``."""
    record = group_layout(layout, heads_per_record)
    layout.for_heads(heads)
    if heads[0] % heads_per_record or heads[1] % heads_per_record:
        raise ConfigError("heads_per_record", heads_per_record,
                          f"a divisor of both ends of the rank's heads [{heads[0]}, {heads[1]})")
    return record


class HeadGroupStore(PageStore):
    """Pages of KV heads ``heads`` of ``layout`` over ``inner``'s head-group records."""

    def __init__(self, inner: PageStore, layout: KVLayout, heads: tuple[int, int],
                 heads_per_record: int = 1) -> None:
        record = check_heads(layout, heads, heads_per_record)
        h0, h1 = heads
        if inner.page_bytes != record.page_bytes:
            raise ValueError(f"the inner store holds {inner.page_bytes}-byte records, a group "
                             f"of {heads_per_record} heads is {record.page_bytes} bytes")
        share = layout.for_heads(heads)
        super().__init__(share.page_bytes)
        self.inner = inner
        self.scheme = inner.scheme
        self.heads = (h0, h1)
        self.groups = (h1 - h0) // heads_per_record
        total = layout.num_kv_heads
        self._tags = [f"\0heads={g}-{g + heads_per_record}/{total}".encode()
                      for g in range(h0, h1, heads_per_record)]
        rows = layout.num_layers * layout.parts * layout.page_size
        self._shape = (rows, h1 - h0, layout.head_dim * layout.itemsize)
        self._group_shape = (rows, heads_per_record, self._shape[2])

    def group_keys(self, key: bytes) -> list[bytes]:
        """The inner keys of one page's records, in head order."""
        return [hashlib.sha256(bytes(key) + tag).digest() for tag in self._tags]

    def _flat_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        return [k for key in keys for k in self.group_keys(key)]

    def _per_page(self, flags: Sequence[bool]) -> list[bool]:
        g = self.groups
        return [all(flags[i:i + g]) for i in range(0, len(flags), g)]

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self._check_open()
        return self._per_page(self.inner.contains(self._flat_keys(keys)))

    def read_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        self._check_batch(keys, buffers)
        if self.groups == 1:
            return self.inner.read_into(self._flat_keys(keys), buffers)
        views = [writable_view(b, self.page_bytes) for b in buffers]
        scratch = np.empty((len(keys), self.groups, *self._group_shape), dtype=np.uint8)
        found = self.inner.read_into(self._flat_keys(keys),
                                     [scratch[i, j] for i in range(len(keys))
                                      for j in range(self.groups)])
        hits = self._per_page(found)
        step = self._group_shape[1]
        for hit, view, records in zip(hits, views, scratch, strict=True):
            if hit:
                page = np.frombuffer(view, dtype=np.uint8).reshape(self._shape)
                for j in range(self.groups):
                    page[:, j * step:(j + 1) * step] = records[j]
        return hits

    def write(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        self._check_batch(keys, buffers)
        if self.groups == 1:
            return self.inner.write(self._flat_keys(keys), buffers)
        step = self._group_shape[1]
        records = []
        for buffer in buffers:
            page = np.frombuffer(readable_view(buffer, self.page_bytes), dtype=np.uint8)
            page = page.reshape(self._shape)
            records += [np.ascontiguousarray(page[:, j * step:(j + 1) * step])
                        for j in range(self.groups)]
        return self._per_page(self.inner.write(self._flat_keys(keys), records))

    def delete(self, keys: Sequence[bytes]) -> int:
        self._check_open()
        return sum(1 for key in keys if self.inner.delete(self.group_keys(key)))

    def stats(self) -> StoreStats:
        """The inner store's records and counters (one page of this view is ``groups`` records)."""
        return self.inner.stats()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.inner.close()
