"""TieredCache under random request sequences (Hypothesis state machine).

Requests share prefixes and tenants; loads are held (pinned) across other requests, pages are
allocated and given back, tiers are flushed. After every step the cache's conservation laws
hold (index counts, prefix closure, pool allocators, pages held outside the index) and every
pinned page still holds exactly the KV of the prompt page it was loaded for.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cache_support import LAYOUT, P, assert_kv, make_cache, write_kv
from kvtier.errors import PoolExhausted
from kvtier.store.memory import MemoryStore

HEADS = [[11] * P + [12] * P, [21] * P]
PROMPTS = [head + [100 + 10 * i + j] * P * (j + 1) for i, head in enumerate(HEADS)
           for j in range(3)]


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = make_cache(device_pages=12, host_pages=16,
                                stores={"disk": MemoryStore(LAYOUT.page_bytes)})
        self.held: list[tuple[list[int], Any]] = []
        self.allocated: list[int] = []

    @rule(i=st.integers(0, len(PROMPTS) - 1), salt=st.sampled_from([None, "t"]),
          recompute=st.integers(0, 2))
    def serve(self, i: int, salt: str | None, recompute: int) -> None:
        tokens = PROMPTS[i]
        loaded = self.cache.load(self.cache.match(tokens, salt), recompute_tokens=recompute * P)
        try:
            start = loaded.start_tokens // P
            assert_kv(self.cache, tokens, loaded.device_page_ids, start)
            held = dict(zip(range(start, loaded.tokens // P), loaded.device_page_ids, strict=True))
            missing = [p for p in range(len(tokens) // P) if p not in held]
            try:
                fresh = self.cache.allocate(len(missing))
            except PoolExhausted:
                return
            for page, page_id in zip(missing, fresh, strict=True):
                held[page] = page_id
                write_kv(self.cache, tokens, [page_id], page)
            self.cache.commit(tokens, [held[p] for p in sorted(held)], salt)
        finally:
            self.cache.release(loaded)

    @precondition(lambda self: len(self.held) < 3)
    @rule(i=st.integers(0, len(PROMPTS) - 1))
    def hold(self, i: int) -> None:
        loaded = self.cache.load(self.cache.match(PROMPTS[i]))
        self.held.append((PROMPTS[i], loaded))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        _tokens, loaded = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.cache.release(loaded)

    @rule(n=st.integers(1, 4))
    def allocate(self, n: int) -> None:
        try:
            self.allocated += self.cache.allocate(n)
        except PoolExhausted:
            pass

    @precondition(lambda self: self.allocated)
    @rule()
    def free(self) -> None:
        self.cache.free(self.allocated)
        self.allocated = []

    @rule()
    def flush(self) -> None:
        self.cache.flush()

    @rule()
    def drain(self) -> None:
        assert self.cache.drain(5.0)

    @invariant()
    def consistent(self) -> None:
        self.cache.check_integrity()
        for tokens, loaded in self.held:
            assert_kv(self.cache, tokens, loaded.device_page_ids, loaded.start_tokens // P)

    def teardown(self) -> None:
        for _tokens, loaded in self.held:
            self.cache.release(loaded)
        self.cache.free(self.allocated)
        self.cache.drain(5.0)
        self.cache.check_integrity()
        self.cache.close()


CacheMachine.TestCase.settings = settings(
    max_examples=25, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestTieredCacheStateMachine = CacheMachine.TestCase
