"""Miniature cache simulations over a spatially sampled page stream (SHARDS-style).

Owns ``PageSampler`` (which pages of a run are in the sample, by a fixed hash of the page's
identity, so the same content is sampled in every process and every run), ``LRUCache`` (the
LRU miniature), ``ClassCache`` (a page-level cache of a fixed capacity that ranks pages by
``last use + weight * class * capacity``, the ranking of ``kvtier.index.policy_shadow``) and
``Duel``, which feeds one sampled reference stream to several such caches at once, keeps a
decayed hit score for each, and names the weight the real tier should use.

A cache of ``C`` pages fed a sample of rate ``R`` of the pages behaves like the full cache
scaled down (``R * C`` pages): the technique of miniature simulations (Waldspurger et al.,
ATC'17). The duel queues sampled references and runs them through the miniatures ``BATCH``
at a time, each miniature's loop over the batch keeping its state in local variables; one
reference costs each miniature a dict lookup and, on a miss, one eviction. Engine thread
only; no torch.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Sequence

CLASSES = 4   # a page came back 0, 1, 2 or 3+ times
UNSET = -1.0
BATCH = 32     # sampled references run through the miniatures at a time
RESIZE_SLACK = 1 / 32  # size changes the miniatures ignore (the tier's fill swinging by a run)


class PageSampler:
    """Picks the pages in the sample by the first two bytes of each page's identity.

    A page's identity is its page key (a content hash, so its bytes are uniform) or, for nodes
    without keys, its token bytes (the replay's one-token pages are block ids). Reading the
    ``[0::step]`` and ``[1::step]`` byte columns is a C-level slice, so a run of any length
    is sampled with a handful of C calls; only sampled pages are copied out.
    """

    def __init__(self) -> None:
        self.rate = UNSET
        self._first = 0          # first byte below this: in the sample
        self._second = 0         # first byte equal to _first: second byte below this
        self._table = b""

    def start(self, rate: float) -> None:
        self.rate = min(max(rate, 0.0), 1.0)
        limit = min(int(self.rate * 65536), 65536)
        self._first, self._second = divmod(limit, 256)
        self._table = bytes(1 if b < self._first or (b == self._first and self._second)
                            else 0 for b in range(256))

    @property
    def started(self) -> bool:
        return self.rate >= 0.0

    def pick(self, buffer: bytes, step: int) -> Sequence[bytes]:
        """The sampled page identities of a run stored as consecutive ``step``-byte pages
        (an empty tuple when none is sampled, the common case)."""
        marks = buffer[::step].translate(self._table)
        if 1 not in marks:
            return ()
        first, second = self._first, self._second
        if first >= 256:
            return [buffer[i:i + step] for i in range(0, len(buffer), step)]
        out: list[bytes] = []
        keep, find = out.append, marks.find
        at = find(1)
        while at >= 0:
            start = at * step
            page = buffer[start:start + step]
            if page[0] < first or (step > 1 and page[1] < second):
                keep(page)
            at = find(1, at + 1)
        return out


class LRUCache:
    """The LRU miniature: one ordered dict of pages, a reference moves its page to the end."""

    __slots__ = ("capacity", "_pages")

    def __init__(self) -> None:
        self.capacity = 1
        self._pages: OrderedDict[bytes, None] = OrderedDict()

    def hits(self, keys: Sequence[bytes]) -> list[bool]:
        """Reference every page of ``keys`` in order; whether each one was a hit."""
        pages, capacity = self._pages, self.capacity
        while len(pages) > capacity:
            pages.popitem(last=False)
        size = len(pages)
        out: list[bool] = []
        hit, move, evict = out.append, pages.move_to_end, pages.popitem
        for key in keys:
            if key in pages:
                move(key)
                hit(True)
            else:
                pages[key] = None
                if size < capacity:
                    size += 1
                else:
                    evict(False)
                hit(False)
        return out

    def __len__(self) -> int:
        return len(self._pages)


class ClassCache:
    """A page cache ranking pages by their deadline ``last use + weight * class * capacity``.

    The deadline is fixed when the page is referenced (as the real tier keys a leaf when it is
    used), so the pages sit in one heap with lazy deletion: a reference pushes the page's new
    entry and ``_deadline`` holds each page's current one; stale entries are skipped when
    popped and dropped when the heap outgrows twice the cache. A miss in a full cache swaps the
    victim's entry for the new page's in one heap operation (``heapreplace``: one sift instead
    of a pop's and a push's), and each class's head start is read from a precomputed tuple
    (the same product ``weight * capacity * class``). Ties go to the lower class, then to the
    older reference (the order of one ordered list per class). Time counts this cache's own
    misses (new content), as the real policy counts pages born.
    """

    __slots__ = ("weight", "capacity", "clock", "_order", "_spans", "_heap", "_deadline")

    def __init__(self, weight: float) -> None:
        if weight <= 0:
            raise ValueError(f"a ClassCache needs a weight > 0 (weight 0 is LRUCache), got {weight}")
        self.weight = weight
        self.capacity = 1
        self.clock = 0
        self._order = 0                  # references so far (ties: the older reference first)
        self._spans = tuple(weight * k for k in range(CLASSES))  # each class's head start
        self._heap: list[tuple[float, int, int, bytes]] = []
        self._deadline: dict[bytes, tuple[float, int, int, bytes]] = {}  # page -> its entry

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        span = self.weight * capacity
        self._spans = tuple(span * k for k in range(CLASSES))

    def lead(self, keys: Sequence[bytes], classes: Sequence[int],
             lru_hits: Sequence[bool]) -> tuple[int, int]:
        """Reference every page of ``keys`` (of ``classes``) in order; the references this
        cache hit and LRU missed (wins) and the reverse (losses)."""
        deadline, spans, capacity = self._deadline, self._spans, self.capacity
        heap, push, pop, replace = self._heap, heapq.heappush, heapq.heappop, heapq.heapreplace
        clock, order, size = self.clock, self._order, len(deadline)
        wins = losses = 0
        for key, klass, lru_hit in zip(keys, classes, lru_hits, strict=True):
            order += 1
            if key in deadline:
                if not lru_hit:
                    wins += 1
                deadline[key] = entry = (clock + spans[klass], klass, order, key)
                push(heap, entry)
                continue
            if lru_hit:
                losses += 1
            clock += 1
            deadline[key] = entry = (clock + spans[klass], klass, order, key)
            if size < capacity:
                size += 1
                push(heap, entry)
                continue
            while size > capacity:        # the first miss after a shrink drops the surplus
                victim = pop(heap)
                if deadline.get(victim[3]) is victim:
                    del deadline[victim[3]]
                    size -= 1
            victim = heap[0]
            while deadline.get(victim[3]) is not victim:   # stale entries on top
                pop(heap)
                victim = heap[0]
            del deadline[victim[3]]       # the victim leaves, the new entry takes its place
            replace(heap, entry)
        self.clock, self._order = clock, order
        if len(heap) > 2 * len(deadline) + 64:
            self._heap = list(deadline.values())
            heapq.heapify(self._heap)
        return wins, losses

    def __len__(self) -> int:
        return len(self._deadline)


class Duel:
    """Several ``ClassCache`` weights on one sampled stream, compared with LRU pair by pair.

    ``weights[0]`` must be 0 (LRU, the safe choice). For each other weight the duel counts the
    references it hit and LRU missed (wins) and the reverse (losses), both halving every
    ``half_life`` miniature cache-fulls of references. A weight is chosen only while its wins
    exceed its losses by more than ``z`` standard deviations of that difference under the
    hypothesis that it is no better than LRU (McNemar's test: ``z * sqrt(wins + losses)``);
    the best such weight wins, and with none the choice is LRU.

    References are queued and run through the miniatures ``batch`` at a time, one cache after
    the other (each cache's state stays in local variables for the whole batch), at the size
    ``target`` names when the batch runs; ``flush`` runs what is queued now.
    """

    def __init__(self, weights: tuple[float, ...], half_life: float, z: float,
                 batch: int = BATCH) -> None:
        if not weights or weights[0] != 0.0:
            raise ValueError("the first weight must be 0 (LRU)")
        if batch < 1:
            raise ValueError(f"batch must be >= 1 reference, got {batch}")
        self.lru = LRUCache()
        self.caches = [ClassCache(w) for w in weights[1:]]
        self.wins = [0.0] * len(self.caches)
        self.losses = [0.0] * len(self.caches)
        self.half_life = half_life
        self.z = z
        self.batch = batch
        self.target = 1.0                # the miniatures' size in pages (set by the owner)
        self.choice = 0.0
        self.refs = 0
        self._next_decision = 0
        self._keys: list[bytes] = []
        self._classes: list[int] = []

    def resize(self, pages: float) -> None:
        """Size the miniatures from the next batch on."""
        self.target = pages

    def ref(self, key: bytes, klass: int) -> None:
        """A reference to sampled page ``key``, of the class the real tier gave its run."""
        self.refs_of((key,), klass)

    def refs_of(self, keys: Sequence[bytes], klass: int) -> None:
        """References to the sampled pages ``keys`` of one run, of the run's class."""
        queued = self._keys
        queued.extend(keys)
        self._classes.extend((klass,) * len(keys))
        if len(queued) >= self.batch:
            self.flush()

    def flush(self) -> None:
        """Run the queued references through every miniature, deciding at the exact
        reference counts a per-reference duel would (the batch is cut there)."""
        keys, classes = self._keys, self._classes
        if not keys:
            return
        self._keys, self._classes = [], []
        capacity = max(int(round(self.target)), 1)
        if abs(capacity - self.lru.capacity) > self.lru.capacity * RESIZE_SLACK:
            self.lru.capacity = capacity
            for cache in self.caches:
                cache.resize(capacity)
        start = 0
        while start < len(keys):
            stop = start + max(self._next_decision - self.refs, 1)
            if start == 0 and stop >= len(keys):
                part, part_classes = keys, classes    # the whole batch before a decision
            else:
                part, part_classes = keys[start:stop], classes[start:stop]
            lru_hits = self.lru.hits(part)
            for i, cache in enumerate(self.caches):
                wins, losses = cache.lead(part, part_classes, lru_hits)
                self.wins[i] += wins
                self.losses[i] += losses
            self.refs += len(part)
            if self.refs >= self._next_decision:
                self._decide()
            start = stop

    def _decide(self) -> None:
        """Every quarter miniature cache-full: pick the weight, then decay the counts."""
        step = max(self.lru.capacity // 4, 1)
        self._next_decision = self.refs + step
        keep = 0.5 ** (step / (self.half_life * self.lru.capacity))
        best, choice = 0.0, 0.0
        for i, cache in enumerate(self.caches):
            lead = self.wins[i] - self.losses[i]
            if lead > best and lead > self.z * math.sqrt(self.wins[i] + self.losses[i]):
                best, choice = lead, cache.weight
            self.wins[i] *= keep
            self.losses[i] *= keep
        self.choice = choice

    def leads(self) -> dict[float, tuple[float, float]]:
        """Each weight's decayed (wins, losses) against LRU."""
        return {c.weight: (self.wins[i], self.losses[i]) for i, c in enumerate(self.caches)}
