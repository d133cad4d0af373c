"""Index moves become KV events: every tier, eviction, promotion, flush, detach, the bounded queue."""

from __future__ import annotations

from cache_support import LAYOUT, P, make_cache, prompt, serve, store_keys
from events_support import apply_event, index_view, new_view, plain
from kvtier.admin.reconfig import StorageAdmin
from kvtier.config import build_config
from kvtier.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventFeed
from kvtier.events.blocks import key_hash
from kvtier.events.encode import event_map
from kvtier.events.queue import DropOldestQueue
from kvtier.store.memory import MemoryStore

CONFIG = build_config(env={}, flags={"cache.page_size": P, "controller.io_workers": 2})


def stores() -> dict[str, MemoryStore]:
    return {"disk": MemoryStore(LAYOUT.page_bytes), "remote": MemoryStore(LAYOUT.page_bytes)}


def apply_all(view, feed: KVEventFeed) -> list:
    events = feed.take()
    for event in events:
        apply_event(view, event_map(event))
    return events


def test_commit_announces_device_pages_with_tokens_and_the_parent_chain():
    with make_cache(host_pages=0) as cache:
        feed = KVEventFeed.local(cache.ctx.index)
        assert feed.take() == [AllBlocksCleared()]  # attach announces an empty index
        head = prompt(2, seed=1)
        serve(cache, head)
        serve(cache, head + prompt(1, seed=2))
        first, second = feed.take()
        keys = store_keys(head + prompt(1, seed=2))
        assert first == BlockStored([key_hash(k) for k in keys[:2]], None, head, P, None, "GPU",
                                    None)
        assert second.block_hashes == [key_hash(keys[2])]
        assert second.parent_block_hash == key_hash(keys[1])
        assert second.token_ids == prompt(1, seed=2)


def test_every_tier_gets_its_medium_and_locality():
    with make_cache(stores=stores()) as cache:
        feed = KVEventFeed.local(cache.ctx.index)
        serve(cache, prompt(2, seed=3))
        assert cache.drain()
        placed = {(e.medium, e.locality) for e in feed.take() if isinstance(e, BlockStored)}
        assert placed == {("GPU", None), ("CPU", None), ("STORAGE", "LOCAL"),
                          ("STORAGE", "REMOTE")}


def test_device_eviction_is_a_removal_and_the_view_follows_the_index():
    with make_cache(device_pages=4, host_pages=0) as cache:
        feed = KVEventFeed.local(cache.ctx.index)
        view = new_view()
        serve(cache, prompt(3, seed=4))
        serve(cache, prompt(3, seed=5))  # needs 3 of 4 pages: the first prompt's run goes
        events = apply_all(view, feed)
        removed = [e for e in events if isinstance(e, BlockRemoved)]
        assert removed and all(e.medium == "GPU" for e in removed)
        assert plain(view) == plain(index_view(cache.ctx.index, feed.recorder.namer))


def test_flush_clears_then_restates_what_the_stores_and_pins_still_hold():
    with make_cache(stores={"disk": MemoryStore(LAYOUT.page_bytes)}) as cache:
        feed = KVEventFeed.local(cache.ctx.index)
        view = new_view()
        serve(cache, prompt(2, seed=6))
        assert cache.drain()
        apply_all(view, feed)
        cache.flush()
        events = apply_all(view, feed)
        assert events[0] == AllBlocksCleared()
        assert not any(isinstance(e, BlockRemoved) for e in events)
        assert {e.medium for e in events[1:]} == {"STORAGE"}
        assert plain(view) == plain(index_view(cache.ctx.index, feed.recorder.namer))


def test_promotion_from_disk_to_host_carries_the_full_token_ids():
    tokens = prompt(3, seed=7)
    with make_cache(stores={"disk": MemoryStore(LAYOUT.page_bytes)}) as cache:
        serve(cache, tokens)
        assert cache.drain()
        cache.flush()
        feed = KVEventFeed.local(cache.ctx.index)
        feed.take()
        serve(cache, tokens)  # lands from disk in the host tier, then on the device
        cpu = [e for e in feed.take() if isinstance(e, BlockStored) and e.medium == "CPU"]
        assert cpu and sum(len(e.token_ids) for e in cpu) == len(tokens)
        assert [t for e in cpu for t in e.token_ids] == tokens


def test_detaching_a_store_clears_and_restates_without_that_tier():
    with make_cache(stores=stores()) as cache:
        feed = KVEventFeed.local(cache.ctx.index)
        view = new_view()
        serve(cache, prompt(2, seed=8))
        assert cache.drain()
        apply_all(view, feed)
        StorageAdmin(cache, CONFIG).detach("remote")
        events = apply_all(view, feed)
        assert events[0] == AllBlocksCleared()
        assert ("STORAGE", "REMOTE") not in plain(view)
        assert plain(view) == plain(index_view(cache.ctx.index, feed.recorder.namer))


def test_no_observer_is_attached_when_events_are_off():
    with make_cache() as cache:
        config = type("Server", (), {"kv_events_endpoint": ""})()
        assert KVEventFeed.from_config(config, cache.ctx.index) is None
        assert cache.ctx.index.observer is None


def test_a_full_queue_drops_the_oldest_and_counts_each_drop():
    queue = DropOldestQueue(3)
    for i in range(5):
        queue.put(i)
    assert queue.take() == [2, 3, 4]
    assert queue.stats() == {"queued": 0, "put_total": 5, "dropped_total": 2, "capacity": 3}
    queue.put(5)
    assert queue.take(limit=0) == [] and queue.take() == [5]


def test_recorder_drops_are_reported_in_its_stats():
    with make_cache(host_pages=0) as cache:
        feed = KVEventFeed.local(cache.ctx.index, queue_events=2)
        for seed in range(4):
            serve(cache, prompt(1, seed=100 + seed))
        assert feed.stats()["recorder"]["dropped_total"] == 3  # 1 clear + 4 stores into 2 slots
        assert len(feed.take()) == 2


def test_after_drops_the_first_move_past_a_caught_up_consumer_restates_everything():
    with make_cache(device_pages=8, host_pages=0) as cache:
        feed = KVEventFeed.local(cache.ctx.index, queue_events=20)
        view = new_view()
        apply_all(view, feed)
        for seed in range(20):  # 20 stores and 16 evictions into 20 slots: the oldest are lost
            serve(cache, prompt(2, seed=200 + seed))
        assert feed.stats()["recorder"]["dropped_total"] == 16
        feed.take()  # the consumer catches up on what survived; a router's view is now stale
        serve(cache, prompt(2, seed=300))
        events = apply_all(view, feed)
        assert events[0] == AllBlocksCleared() and feed.stats()["recorder"]["repairs_total"] == 1
        assert plain(view) == plain(index_view(cache.ctx.index, feed.recorder.namer))


def test_a_flush_after_drops_is_itself_the_repair():
    with make_cache(device_pages=8, host_pages=0) as cache:
        feed = KVEventFeed.local(cache.ctx.index, queue_events=20)
        for seed in range(20):
            serve(cache, prompt(2, seed=400 + seed))
        feed.take()
        cache.flush()
        view = new_view()
        apply_all(view, feed)
        serve(cache, prompt(2, seed=500))
        apply_all(view, feed)
        assert feed.stats()["recorder"]["repairs_total"] == 0  # the flush restated everything
        assert plain(view) == plain(index_view(cache.ctx.index, feed.recorder.namer))
