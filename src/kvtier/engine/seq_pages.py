"""Which device pages hold each running sequence's KV, with the tiered cache or without it.

Owns ``SeqPages`` (one sequence's page table: pages in prefix order, the ones it allocated,
the pins it holds) and the two page sources the batched engine draws from:

- ``PlainPages``: a device pool of its own, nothing shared (``cache.enabled`` false, the
  baseline). Pages are allocated as a sequence grows and freed when it ends.
- ``CachedPages``: pages of the ``TieredCache`` (``PrefixCache.tiered``). ``open`` matches the
  prompt and puts the hit's device pages straight into the table (pinned by a ``Loaded``: the
  model reads them in place; a hit held by the host tier is copied into device pages, on CUDA
  layer by layer under the forward). A hit with a store part (disk, remote) is split as the
  planner says: its head is recomputed into fresh pages while the tail's store reads run, and
  ``load_tail`` appends the tail's pages when the head is done. ``commit_prompt`` indexes the
  prompt's full pages once the first token is out and pins them again, so other prompts hit
  them while this one decodes; ``close`` commits the rest and unpins.

A prompt cached whole still runs its last token: that token's page is copied into a private
page first (pages the index holds are shared and never written). Engine thread only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.engine.prefix import PrefixCache, _attribute
from kvtier.engine.request import PrefillReport
from kvtier.errors import PoolExhausted
from kvtier.memory.device_pool import DevicePool


@dataclass
class SeqPages:
    """One sequence's pages: ``table[i]`` holds tokens ``[i * page_size, (i + 1) * page_size)``."""

    table: list[int] = field(default_factory=list)
    owned: set[int] = field(default_factory=set)   # allocated here, not committed yet
    pin: Any = None                                 # a ``Loaded`` pinning shared pages
    ticket: Any = None                              # a copy into the table still in flight
    salt: str | None = None
    tail: tuple[Any, int] | None = None             # (hit, head tokens) of a split in progress
    split: tuple[int, float, float] | None = None   # (hit tokens, predicted s, start)
    committed_pages: int = 0


class PlainPages:
    """Pages from a pool of the engine's own; no cache, nothing shared."""

    def __init__(self, pool: DevicePool) -> None:
        self.device_pool = pool
        self.page_size = int(pool.kv.shape[3])

    @property
    def kv(self) -> torch.Tensor:
        return self.device_pool.kv

    def open(self, tokens: list[int], salt: str | None, report: PrefillReport) -> tuple[SeqPages, int]:
        return SeqPages(salt=salt), 0

    def grow(self, pages: SeqPages, tokens: int) -> None:
        """Make ``pages`` hold at least ``tokens`` tokens; ``PoolExhausted`` if it cannot."""
        missing = -(-tokens // self.page_size) - len(pages.table)
        if missing > 0:
            fresh = self.device_pool.allocator.allocate(missing)
            pages.table += fresh
            pages.owned.update(fresh)

    def commit_prompt(self, pages: SeqPages, tokens: list[int]) -> None:
        pages.ticket = None

    def scratch_page(self) -> int:
        """A page for the engine alone (padding rows of captured decodes write it), never freed."""
        return self.device_pool.allocator.allocate(1)[0]

    def close(self, pages: SeqPages, tokens: list[int], *, commit: bool) -> None:
        self.device_pool.allocator.free(sorted(pages.owned))
        pages.owned.clear()
        pages.table = []

    def stats(self) -> dict[str, Any]:
        return {"device_pages": self.device_pool.num_pages,
                "free_pages": self.device_pool.allocator.num_free}


class CachedPages(PlainPages):
    """Pages of the tiered cache; see the module docstring."""

    def __init__(self, prefix: PrefixCache) -> None:
        self.prefix, self.tiered = prefix, prefix.tiered
        self.page_size = prefix.page_size

    @property
    def device_pool(self) -> DevicePool:
        return self.tiered.device_pool

    @property
    def kv(self) -> torch.Tensor:
        return self.tiered.device_pool.kv

    def open(self, tokens: list[int], salt: str | None, report: PrefillReport) -> tuple[SeqPages, int]:
        """A page table starting with the prompt's hit; returns it and the tokens it holds."""
        hit = self.tiered.match(tokens, salt)
        report.matched_tokens = hit.tokens
        head = self.prefix.head_tokens(hit)
        pages = SeqPages(salt=salt)
        if head >= hit.tokens:   # nothing to load: the hit is recomputed with the prompt
            _account(report, hit, hit.tokens if hit.tokens else 0, 0)
            return pages, 0
        if head:
            pending = self.tiered.pending_split
            if pending is not None:
                pages.split = (pending[0], pending[1], time.perf_counter())
            self.tiered.prefetch(hit, recompute_tokens=head)
            pages.tail = (hit, head)
            _account(report, hit, head, 0)
            return pages, 0
        return pages, self._adopt(pages, self.prefix.load_hit(hit, 0), 0, len(tokens), report)

    def load_tail(self, pages: SeqPages, tokens: int, report: PrefillReport) -> int:
        """The head of a split is computed: load its tail (waits for the store reads), append
        its pages; returns the tokens the table now holds."""
        hit, head = pages.tail
        pages.tail = None
        return self._adopt(pages, self.prefix.load_hit(hit, head), head, tokens, report)

    def _adopt(self, pages: SeqPages, loaded: Any, head: int, prompt_tokens: int,
               report: PrefillReport) -> int:
        span = self.prefix.usable_span(loaded, head)
        if span is None:
            self.tiered.release(loaded)
            _account(report, loaded.hit, head, 0)
            return head
        pages.pin, pages.ticket = loaded, loaded.ticket
        pages.table = pages.table[:head // self.page_size] + span[2]
        held = span[1]
        if held >= prompt_tokens:   # the last position must run: it writes a private page
            held = prompt_tokens - 1
            if not self._copy_on_write(pages, held // self.page_size):
                held -= held % self.page_size   # no page to copy into: recompute that page
        _account(report, loaded.hit, head, held - head)
        return held

    def _copy_on_write(self, pages: SeqPages, index: int) -> bool:
        """Put a private copy of page ``index`` last in the table (pages past it dropped);
        False, with the table cut before ``index``, when the pool has no page for it."""
        try:
            fresh = self.tiered.allocate(1)[0]
        except PoolExhausted:
            pages.table = pages.table[:index]
            return False
        if pages.ticket is not None:
            pages.ticket.stream_wait()
        kv = self.kv
        kv[:, :, fresh].copy_(kv[:, :, pages.table[index]])
        pages.table = pages.table[:index] + [fresh]
        pages.owned.add(fresh)
        return True

    def scratch_page(self) -> int:
        return self.tiered.allocate(1)[0]

    def grow(self, pages: SeqPages, tokens: int) -> None:
        missing = -(-tokens // self.page_size) - len(pages.table)
        if missing > 0:
            fresh = self.tiered.allocate(missing)
            pages.table += fresh
            pages.owned.update(fresh)

    def commit_prompt(self, pages: SeqPages, tokens: list[int]) -> None:
        """Index the full pages of ``tokens`` (the prompt, its first token out) and pin them
        again: the index may keep its own copy of a page and free this one."""
        if pages.split is not None:
            hit_tokens, predicted, started = pages.split
            pages.split = None
            self.tiered.observe_split(hit_tokens, predicted, time.perf_counter() - started)
        self._commit(pages, tokens)

    def _commit(self, pages: SeqPages, tokens: list[int]) -> None:
        full = len(tokens) // self.page_size
        if full <= pages.committed_pages:
            return
        self.tiered.commit(tokens[:full * self.page_size], pages.table[:full], pages.salt,
                           loaded=pages.pin)
        pages.owned.difference_update(pages.table[:full])
        old, pages.pin, pages.ticket = pages.pin, None, None
        hit = self.tiered.match(tokens[:full * self.page_size], pages.salt)
        pin = self.tiered.load(hit)
        if old is not None:
            self.tiered.release(old)
        pages.pin = pin
        if pin.tokens < full * self.page_size or pin.start_tokens:
            raise RuntimeError(f"committed {full} pages but the device tier pins "
                               f"{pin.tokens // self.page_size}")
        pages.table[:full] = pin.device_page_ids[:full]
        pages.committed_pages = full

    def close(self, pages: SeqPages, tokens: list[int], *, commit: bool) -> None:
        """Commit the full pages of ``tokens`` (whose KV the table holds) unless ``commit`` is
        false, then free the pages still owned and drop the pins."""
        try:
            if commit and tokens:
                self._commit(pages, tokens)
        finally:
            if pages.tail is not None:
                self.tiered.release(pages.tail[0])
                pages.tail = None
            self.tiered.free(sorted(pages.owned))
            pages.owned.clear()
            if pages.pin is not None:
                self.tiered.release(pages.pin)
            pages.pin, pages.ticket, pages.table = None, None, []

    def stats(self) -> dict[str, Any]:
        return {}


def _account(report: PrefillReport, hit: Any, head: int, reused: int) -> None:
    report.cached_tokens = reused
    report.recomputed_hit_tokens = min(head, hit.tokens)
    report.cached_by_tier = _attribute(hit.tokens_by_tier, head, reused)

