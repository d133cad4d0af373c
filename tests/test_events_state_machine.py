"""A subscriber's view of the KV event stream equals the index after any sequence of moves.

Hypothesis drives a TieredCache with every tier (device, host, a disk and a remote store): requests
from two tenants sharing prefixes, loads held across other requests, IO completions, flushes, a
remote store detached and attached again, evictions from small pools. After every step the
events so far are encoded to the wire, decoded with a plain msgpack decoder and applied to a
subscriber's view, which must equal what the index holds, tier by tier, block by block, with the
right tokens for every block.
"""

from __future__ import annotations

import uuid
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cache_support import LAYOUT, P, make_cache, serve
from events_support import apply_payload, index_view, new_view, plain
from kvtier.admin.reconfig import StorageAdmin
from kvtier.config import build_config
from kvtier.errors import PoolExhausted
from kvtier.events import KVEventFeed
from kvtier.events.encode import encode_batch
from kvtier.store.memory import MemoryStore

HEADS = [[11] * P + [12] * P, [21] * P]
PROMPTS = [head + [100 + 10 * i + j] * P * (j + 1) for i, head in enumerate(HEADS)
           for j in range(3)]
CONFIG = build_config(env={}, flags={"cache.page_size": P, "controller.io_workers": 2,
                                     "controller.min_prefetch_tokens": 0})


class EventViewMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = make_cache(device_pages=10, host_pages=12,
                                stores={"disk": MemoryStore(LAYOUT.page_bytes),
                                        "remote": MemoryStore(LAYOUT.page_bytes)})
        self.admin = StorageAdmin(self.cache, CONFIG)
        self.held: list[Any] = []
        self.view = new_view()
        self.feed: KVEventFeed | None = None

    @initialize(block_size=st.sampled_from([0, 1, 2]))
    def attach(self, block_size: int) -> None:
        self.feed = KVEventFeed.local(self.cache.ctx.index, block_size=block_size)

    @rule(i=st.integers(0, len(PROMPTS) - 1), salt=st.sampled_from([None, "t"]))
    def request(self, i: int, salt: str | None) -> None:
        try:
            serve(self.cache, PROMPTS[i], salt, check=False)
        except PoolExhausted:
            pass

    @precondition(lambda self: len(self.held) < 2)
    @rule(i=st.integers(0, len(PROMPTS) - 1))
    def hold(self, i: int) -> None:
        self.held.append(self.cache.load(self.cache.match(PROMPTS[i])))

    @precondition(lambda self: self.held)
    @rule()
    def release(self) -> None:
        self.cache.release(self.held.pop(0))

    @rule()
    def complete_io(self) -> None:
        self.cache.drain(timeout_s=2.0)

    @rule()
    def flush(self) -> None:
        self.cache.flush()

    @precondition(lambda self: "remote" in self.cache.ctx.stores)
    @rule()
    def detach_remote(self) -> None:
        self.admin.detach("remote")

    @precondition(lambda self: "remote" not in self.cache.ctx.stores)
    @rule()
    def attach_remote(self) -> None:
        self.admin.attach("remote", f"memory://events-{uuid.uuid4().hex}")

    @invariant()
    def subscriber_view_equals_the_index(self) -> None:
        if self.feed is None:
            return
        events = self.feed.take()
        if events:
            apply_payload(self.view, encode_batch(1.0, events, 0))
        want = index_view(self.cache.ctx.index, self.feed.recorder.namer)
        assert plain(self.view) == plain(want)
        assert self.feed.stats()["recorder"]["dropped_total"] == 0

    def teardown(self) -> None:
        for loaded in self.held:
            self.cache.release(loaded)
        if self.feed is not None:
            self.feed.close()
        self.cache.close()


EventViewMachine.TestCase.settings = settings(
    max_examples=25, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestEventView = EventViewMachine.TestCase
