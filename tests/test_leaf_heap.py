"""LeafHeap: lowest key first, re-keyed and discarded leaves never come out stale."""

from __future__ import annotations

import random

from kvtier.index.eviction import LeafHeap


def test_lowest_key_first_and_ties_in_push_order():
    heap = LeafHeap()
    for node, key in [("b", 2.0), ("a", 1.0), ("c", 2.0)]:
        heap.push(node, key)
    assert [heap.pop_min() for _ in range(4)] == ["a", "b", "c", None]


def test_a_new_key_replaces_the_old_one():
    heap = LeafHeap()
    heap.push("a", 1.0)
    heap.push("b", 2.0)
    heap.push("a", 3.0)
    assert heap.pop_min() == "b" and heap.pop_min() == "a" and heap.pop_min() is None


def test_discarded_and_forgotten_leaves_are_never_returned():
    heap = LeafHeap()
    for i, node in enumerate("abcd"):
        heap.push(node, float(i))
    heap.discard("a")
    heap.forget("b")
    assert "a" not in heap and len(heap) == 2
    assert [heap.pop_min(), heap.pop_min(), heap.pop_min()] == ["c", "d", None]


def test_many_rekeys_match_a_sorted_model_through_rebuilds():
    rng = random.Random(3)
    heap, model = LeafHeap(), {}
    for step in range(5000):
        node = rng.randrange(50)
        if rng.random() < 0.2:
            heap.discard(node)
            model.pop(node, None)
        else:
            heap.push(node, float(step))
            model[node] = float(step)
    assert len(heap) == len(model)
    popped = [heap.pop_min() for _ in range(len(model))]
    assert popped == sorted(model, key=model.get) and heap.pop_min() is None


def test_peek_shows_the_lowest_live_leaf_without_taking_it():
    heap = LeafHeap()
    assert heap.peek_min() is None
    heap.push("a", 1.0)
    heap.push("b", 2.0)
    heap.push("a", 3.0)                       # a's first entry is stale now
    assert heap.peek_min() == (2.0, "b") and len(heap) == 2
    heap.discard("b")
    assert heap.peek_min() == (3.0, "a")
    assert heap.pop_min() == "a" and heap.peek_min() is None
