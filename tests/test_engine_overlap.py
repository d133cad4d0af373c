"""A host hit loaded under the forward (``overlap``): each layer waits for its own copy only, the
output is exactly a recompute's, and the host pages the copy reads stay locked until release.

The CPU has no side streams, so the copy engine is replaced by one whose layer-wise loads land
only when a consumer waits for a layer (as the device does with ``stream_wait``); the destination
pages are poisoned until then, so reading a layer before waiting for it gives wrong logits."""

from __future__ import annotations

import pytest
import torch

from test_engine_cache_matrix import NEW_TOKENS, TOLERANCE, build, reference, through
from test_engine_prefix import _prompt
from test_engine_support import tiny_lm


class LazyTicket:
    """A per-layer copy that lands layer ``l`` when somebody waits for layer ``l``."""

    def __init__(self, copy: LazyCopy, host_ids: list[int], device_ids: list[int]) -> None:
        self.copy, self.host_ids, self.device_ids = copy, host_ids, device_ids
        self.landed: set[int] = set()
        pool = copy.inner.device_pool.kv
        pool[:, :, device_ids] = float("nan")

    def _land(self, layer: int) -> None:
        if layer not in self.landed:
            self.copy.inner.load(self.host_ids, self.device_ids, layers=range(layer, layer + 1))
            self.landed.add(layer)
            self.copy.waits.append(layer)

    def stream_wait(self, stream=None, layer: int | None = None) -> None:
        for one in range(self.copy.num_layers) if layer is None else [layer]:
            self._land(one)

    def wait(self, timeout: float | None = None) -> bool:
        self.stream_wait()
        return True

    def is_done(self) -> bool:
        return len(self.landed) == self.copy.num_layers


class LazyCopy:
    """Wraps the real copy engine; only ``load_layerwise`` is deferred."""

    asynchronous = True

    def __init__(self, inner) -> None:
        self.inner = inner
        self.num_layers = inner.device_pool.kv.shape[0]
        self.waits: list[int] = []
        self.tickets: list[LazyTicket] = []

    def load_layerwise(self, host_ids, device_ids, layers=None) -> LazyTicket:
        ticket = LazyTicket(self, list(host_ids), list(device_ids))
        self.tickets.append(ticket)
        return ticket

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@pytest.fixture
def cache(tmp_path):
    prefix_cache = build(tiny_lm(), 16, tmp_path)
    lazy = LazyCopy(prefix_cache.tiered.ctx.copy)
    prefix_cache.tiered.ctx.copy = lazy
    yield prefix_cache, lazy
    prefix_cache.close()


def test_host_hit_waits_layer_by_layer_and_matches_recompute(cache):
    prefix_cache, lazy = cache
    prompt = _prompt(75, 1)
    want = reference(prefix_cache.lm, prompt)
    through(prefix_cache, prompt)
    prefix_cache.drop_tiers(("device",))
    got = through(prefix_cache, prompt)
    assert got.report.cached_by_tier["host"] == 64
    assert len(lazy.tickets) == 1
    assert lazy.waits == list(range(lazy.num_layers))  # each layer once, in forward order
    assert got.tokens == want.tokens and len(got.tokens) == NEW_TOKENS
    assert float((got.logits - want.logits).abs().max()) <= TOLERANCE


def test_without_overlap_the_load_is_waited_whole(cache):
    prefix_cache, lazy = cache
    prefix_cache.overlap = False
    prompt = _prompt(40, 2)
    through(prefix_cache, prompt)
    prefix_cache.drop_tiers(("device",))
    assert through(prefix_cache, prompt).report.cached_by_tier["host"] == 32
    assert lazy.tickets == []


def test_release_waits_for_the_copy_and_host_pages_stay_locked_until_then(cache):
    prefix_cache, lazy = cache
    tiered = prefix_cache.tiered
    prompt = _prompt(50, 3)
    through(prefix_cache, prompt)
    prefix_cache.drop_tiers(("device",))
    hit = tiered.match(prompt)
    loaded = tiered.load(hit, overlap=True)
    ticket = loaded.ticket
    assert ticket is not None and not ticket.is_done()
    tiered.flush()  # drops unlocked host pages: the ones the copy reads are locked
    assert tiered.stats()["tiers"]["host"]["pages"] == 3
    tiered.release(loaded)
    assert ticket.is_done()
    pool = tiered.device_pool.kv[:, :, loaded.device_page_ids]
    assert not torch.isnan(pool).any()
    tiered.flush()
    assert tiered.stats()["tiers"]["host"]["pages"] == 0
    tiered.check_integrity()
