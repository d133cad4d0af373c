"""The contract every ``PageStore`` backend passes: shared tests plus a dict-model state machine.

A backend's test module subclasses ``StoreContract`` and implements the hooks::

    class TestFileStore(StoreContract):
        page_bytes = 4099                      # optional: the page size the shared tests use
        persistent = True                      # the backend keeps pages across reopen()

        def make_store(self, tmp_path, page_bytes):
            # A fresh, empty store with room for at least a few hundred pages (no eviction
            # during the shared tests). ``tmp_path`` is a fresh directory; use it or ignore it.
            return open_store(f"file://{tmp_path}/store", page_bytes=page_bytes)

        def reopen(self, store):
            # Close ``store`` and open the same location again (only if ``persistent``).
            ...

Every test method here then runs against that backend, including
``test_state_machine_matches_dict_model``, which drives the store with random batches of
writes, reads, contains, deletes (and reopens, for persistent backends) and checks it against a
plain ``dict``. ``page_store_machine(...)`` builds that machine for any factory, so other test
modules (wrappers, tiers) can reuse it.

Pages in these tests are deterministic pseudo-random bytes (``page_bytes_for``), keys are
SHA-256 digests (``key_for``), so a failure message names a reproducible page.
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvtier.errors import StoreClosed
from kvtier.layout import ByteRange
from kvtier.store.base import PageStore


def key_for(i: int) -> bytes:
    """A stable 32-byte page key for test page number ``i``."""
    return hashlib.sha256(b"kvtier-test-page-%d" % i).digest()


def page_bytes_for(seed: int, page_bytes: int) -> bytes:
    """Deterministic pseudo-random page content for ``seed``."""
    return random.Random(seed).randbytes(page_bytes)


# ---------------------------------------------------------------------------------------------
# The state machine
# ---------------------------------------------------------------------------------------------

#: A small pool of keys, so writes, overwrites, deletes and reads keep meeting each other.
MACHINE_KEYS = 10

_key_index = st.integers(min_value=0, max_value=MACHINE_KEYS - 1)
_write_batch = st.lists(st.tuples(_key_index, st.integers(0, 2**32)), min_size=1, max_size=4)
_key_batch = st.lists(_key_index, min_size=0, max_size=6)


def page_store_machine(open_fresh: Callable[[], PageStore], page_bytes: int,
                       reopen: Callable[[PageStore], PageStore] | None = None,
                       exact_page_count: bool = True) -> type[RuleBasedStateMachine]:
    """A state machine class checking stores made by ``open_fresh()`` against a dict model.

    ``reopen`` (close a store, open the same location again) adds a reopen rule: everything
    written before must still be there. ``exact_page_count`` checks ``stats().pages`` and
    ``stats().bytes`` against the model after every step.
    """

    class PageStoreMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.store: PageStore | None = None
            self.model: dict[bytes, bytes] = {}
            self.hits = self.misses = 0

        @initialize()
        def open_store(self) -> None:
            self.store = open_fresh()
            self._base = self.store.stats()

        @rule(batch=_write_batch)
        def write(self, batch: list[tuple[int, int]]) -> None:
            keys = [key_for(i) for i, _ in batch]
            pages = [page_bytes_for(seed, page_bytes) for _, seed in batch]
            assert self.store.write(keys, pages) == [True] * len(keys)
            self.model.update(zip(keys, pages, strict=True))  # later duplicates win

        @rule(indexes=_key_batch)
        def read(self, indexes: list[int]) -> None:
            keys = [key_for(i) for i in indexes]
            buffers = [np.zeros(page_bytes, np.uint8) for _ in keys]
            found = self.store.read_into(keys, buffers)
            assert found == [k in self.model for k in keys]
            for key, ok, buf in zip(keys, found, buffers, strict=True):
                if ok:
                    assert buf.tobytes() == self.model[key], f"wrong bytes for {key.hex()[:12]}"
            self.hits += sum(found)
            self.misses += len(found) - sum(found)

        @rule(indexes=_key_batch)
        def contains(self, indexes: list[int]) -> None:
            keys = [key_for(i) for i in indexes]
            assert self.store.contains(keys) == [k in self.model for k in keys]

        @rule(indexes=_key_batch)
        def delete(self, indexes: list[int]) -> None:
            keys = [key_for(i) for i in indexes]
            expected = sum(self.model.pop(k, None) is not None for k in keys)
            assert self.store.delete(keys) == expected

        @precondition(lambda self: reopen is not None)
        @rule()
        def reopen_store(self) -> None:
            self.store = reopen(self.store)
            self._base = self.store.stats()
            self.hits = self.misses = 0

        @invariant()
        def stats_follow_model(self) -> None:
            if self.store is None:
                return
            stats = self.store.stats()
            assert stats.hits - self._base.hits == self.hits
            assert stats.misses - self._base.misses == self.misses
            if exact_page_count:
                assert stats.pages == len(self.model)
                assert stats.bytes == len(self.model) * page_bytes

        def teardown(self) -> None:
            if self.store is not None:
                self.store.close()

    return PageStoreMachine


# ---------------------------------------------------------------------------------------------
# The shared tests
# ---------------------------------------------------------------------------------------------


class StoreContract:
    """Tests every backend passes; subclass it as ``Test<Backend>`` and implement the hooks."""

    #: Page size of the shared tests: odd on purpose, so nothing assumes alignment.
    page_bytes: int = 4099
    #: True when ``reopen`` keeps pages (file, redis, named memory stores).
    persistent: bool = False
    #: False for backends whose ``stats().pages`` is approximate (e.g. shared servers).
    exact_page_count: bool = True
    #: Bounds of the state-machine run (kept small: the whole suite runs on 2 cores).
    machine_examples: int = 25
    machine_steps: int = 25

    # ---- hooks ---------------------------------------------------------------------------
    def make_store(self, tmp_path: Path, page_bytes: int) -> PageStore:
        """A fresh, empty store with room for a few hundred pages."""
        raise NotImplementedError

    def reopen(self, store: PageStore) -> PageStore:
        """Close ``store`` and open the same location again (persistent backends only)."""
        raise NotImplementedError

    # ---- helpers -------------------------------------------------------------------------
    @pytest.fixture
    def store(self, tmp_path: Path) -> Any:
        store = self.make_store(tmp_path, self.page_bytes)
        yield store
        store.close()

    def page(self, seed: int) -> bytes:
        return page_bytes_for(seed, self.page_bytes)

    def read(self, store: PageStore, indexes: list[int]) -> list[bytes | None]:
        buffers = [np.zeros(self.page_bytes, np.uint8) for _ in indexes]
        found = store.read_into([key_for(i) for i in indexes], buffers)
        return [b.tobytes() if ok else None for ok, b in zip(found, buffers, strict=True)]

    def fill(self, store: PageStore, indexes: list[int], seed_offset: int = 0) -> None:
        pages = [self.page(i + seed_offset) for i in indexes]
        assert store.write([key_for(i) for i in indexes], pages) == [True] * len(indexes)

    # ---- round trips ---------------------------------------------------------------------
    def test_written_pages_read_back_byte_for_byte(self, store: PageStore) -> None:
        self.fill(store, list(range(8)))
        assert self.read(store, list(range(8))) == [self.page(i) for i in range(8)]

    def test_unwritten_key_is_a_counted_miss(self, store: PageStore) -> None:
        self.fill(store, [1])
        before = store.stats()
        assert self.read(store, [1, 2, 1]) == [self.page(1), None, self.page(1)]
        after = store.stats()
        assert (after.hits - before.hits, after.misses - before.misses) == (2, 1)

    def test_contains_answers_each_key_in_order(self, store: PageStore) -> None:
        self.fill(store, [0, 2, 4])
        assert store.contains([key_for(i) for i in range(6)]) == [True, False] * 3
        assert store.contains([]) == []

    def test_contains_prefix_counts_leading_pages(self, store: PageStore) -> None:
        self.fill(store, [0, 1, 2, 4])
        assert store.contains_prefix([key_for(i) for i in range(6)]) == 3
        assert store.contains_prefix([key_for(9), key_for(0)]) == 0

    def test_overwrite_replaces_the_page(self, store: PageStore) -> None:
        self.fill(store, [3])
        self.fill(store, [3], seed_offset=1000)
        assert self.read(store, [3]) == [self.page(1003)]
        assert store.stats().pages == 1 or not self.exact_page_count

    def test_duplicate_keys_in_one_write_keep_the_last(self, store: PageStore) -> None:
        pages = [self.page(10), self.page(11)]
        assert store.write([key_for(5), key_for(5)], pages) == [True, True]
        assert self.read(store, [5]) == [self.page(11)]

    def test_delete_counts_existing_pages_and_hides_them(self, store: PageStore) -> None:
        self.fill(store, [0, 1, 2])
        assert store.delete([key_for(1), key_for(7), key_for(1)]) == 1
        assert store.contains([key_for(i) for i in range(3)]) == [True, False, True]
        assert self.read(store, [1]) == [None]
        self.fill(store, [1], seed_offset=50)
        assert self.read(store, [1]) == [self.page(51)]

    def test_empty_batches_do_nothing(self, store: PageStore) -> None:
        assert store.write([], []) == []
        assert store.read_into([], []) == []
        assert store.delete([]) == 0

    def test_stats_follow_contents(self, store: PageStore) -> None:
        self.fill(store, list(range(5)))
        store.delete([key_for(0)])
        stats = store.stats()
        assert stats.backend == store.scheme
        if self.exact_page_count:
            assert (stats.pages, stats.bytes) == (4, 4 * self.page_bytes)
        assert stats.bytes_written >= 5 * self.page_bytes

    # ---- buffers -------------------------------------------------------------------------
    def test_every_buffer_kind_reads_and_writes(self, store: PageStore) -> None:
        import torch

        n = self.page_bytes
        sources = [self.page(i) for i in range(4)]
        writes = [np.frombuffer(sources[0], np.uint8), bytearray(sources[1]),
                  memoryview(sources[2]), torch.frombuffer(bytearray(sources[3]), dtype=torch.uint8)]
        assert store.write([key_for(i) for i in range(4)], writes) == [True] * 4
        dests = [np.zeros(n, np.uint8), bytearray(n), memoryview(bytearray(n)),
                 torch.zeros(n, dtype=torch.uint8)]
        assert store.read_into([key_for(i) for i in range(4)], dests) == [True] * 4
        got = [bytes(dests[0]), bytes(dests[1]), bytes(dests[2]), dests[3].numpy().tobytes()]
        assert got == sources

    def test_reads_land_in_slices_of_a_larger_buffer(self, store: PageStore) -> None:
        self.fill(store, [0, 1])
        pool = np.zeros((3, self.page_bytes), np.uint8)
        assert store.read_into([key_for(1), key_for(0)], [pool[2], pool[0]]) == [True, True]
        assert pool[2].tobytes() == self.page(1) and pool[0].tobytes() == self.page(0)
        assert not pool[1].any()

    def test_misuse_raises(self, store: PageStore) -> None:
        n = self.page_bytes
        with pytest.raises(ValueError):
            store.write([key_for(0)], [bytes(n - 1)])
        with pytest.raises(ValueError):
            store.read_into([key_for(0)], [bytearray(n + 1)])
        with pytest.raises(ValueError):
            store.read_into([key_for(0)], [bytes(n)])  # read-only destination
        with pytest.raises(ValueError):
            store.write([key_for(0), key_for(1)], [bytes(n)])

    def test_closed_store_raises_and_close_is_idempotent(self, store: PageStore) -> None:
        self.fill(store, [0])
        store.close()
        store.close()
        with pytest.raises(StoreClosed):
            store.contains([key_for(0)])
        with pytest.raises(StoreClosed):
            store.read_into([key_for(0)], [bytearray(self.page_bytes)])
        with pytest.raises(StoreClosed):
            store.write([key_for(0)], [bytes(self.page_bytes)])

    # ---- partial reads -------------------------------------------------------------------
    def test_read_ranges_into_packs_only_the_ranges(self, store: PageStore) -> None:
        self.fill(store, [0])
        ranges = [ByteRange(0, 7), ByteRange(100, 33), ByteRange(self.page_bytes - 9, 9)]
        out = [np.zeros(49, np.uint8), np.zeros(49, np.uint8)]
        assert store.read_ranges_into([key_for(0), key_for(1)], ranges, out) == [True, False]
        page = self.page(0)
        assert out[0].tobytes() == page[:7] + page[100:133] + page[-9:]

    # ---- concurrency ---------------------------------------------------------------------
    def test_threads_write_and_read_their_own_pages(self, store: PageStore) -> None:
        errors: list[BaseException] = []

        def worker(t: int) -> None:
            try:
                mine = [t * 100 + i for i in range(6)]
                self.fill(store, mine)
                assert self.read(store, mine) == [self.page(i) for i in mine]
            except BaseException as exc:  # reported below, on the test thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors

    def test_reader_sees_old_or_new_page_never_a_mix(self, store: PageStore) -> None:
        old, new = self.page(1), self.page(2)
        self.fill(store, [0], seed_offset=1)
        stop = threading.Event()
        seen: list[bytes | None] = []

        def reader() -> None:
            while not stop.is_set():
                seen.extend(self.read(store, [0]))

        th = threading.Thread(target=reader)
        th.start()
        for round_ in range(20):
            store.write([key_for(0)], [new if round_ % 2 == 0 else old])
        stop.set()
        th.join()
        assert seen and all(page in (old, new) for page in seen)

    # ---- persistence ---------------------------------------------------------------------
    def test_pages_and_deletes_survive_reopen(self, store: PageStore) -> None:
        if not self.persistent:
            pytest.skip("backend is not persistent")
        self.fill(store, list(range(6)))
        store.delete([key_for(2)])
        self.fill(store, [3], seed_offset=500)
        store = self.reopen(store)
        try:
            expected = [self.page(i) for i in range(6)]
            expected[2], expected[3] = None, self.page(503)
            assert self.read(store, list(range(6))) == expected
            if self.exact_page_count:
                assert store.stats().pages == 5
        finally:
            store.close()

    # ---- the model check -----------------------------------------------------------------
    def test_state_machine_matches_dict_model(self, tmp_path: Path) -> None:
        counter = iter(range(1_000_000))

        def fresh() -> PageStore:
            where = tmp_path / f"machine-{next(counter)}"
            where.mkdir()
            return self.make_store(where, self.page_bytes)

        machine = page_store_machine(fresh, self.page_bytes,
                                     reopen=self.reopen if self.persistent else None,
                                     exact_page_count=self.exact_page_count)
        run_state_machine_as_test(machine, settings=settings(
            max_examples=self.machine_examples, stateful_step_count=self.machine_steps,
            deadline=None, suppress_health_check=list(HealthCheck), database=None))
