"""Cache hints: the providers' vocabularies parse or fail naming the field; ``HintBook`` gives a
hinted prefix a head start that expires, bounds a tenant by its share and counts the rest; a
trace carries hints through a replay, and on a flood of one-off prompts the hinted documents
survive where LRU loses them."""

from __future__ import annotations

import pytest

from kvtier.controller.hints import HintBook
from kvtier.errors import ConfigError
from kvtier.hints import CacheHint, HintError, cache_control_hint, openai_hint, strongest
from kvtier.index.radix import RadixIndex
from kvtier.replay import synthetic
from kvtier.replay.simulator import ReplayConfig, replay
from kvtier.replay.trace import parse_lines


def test_openai_fields_map_to_retention_and_a_key_alone_means_in_memory():
    assert openai_hint(None, "24h") == CacheHint(86_400.0, None, "openai")
    assert openai_hint("tenant-a", None) == CacheHint(300.0, "tenant-a", "openai")
    assert openai_hint(None, None) is None


@pytest.mark.parametrize(("call", "field"), [
    (lambda: openai_hint(None, "forever"), "prompt_cache_retention"),
    (lambda: openai_hint(None, ["24h"]), "prompt_cache_retention"),
    (lambda: cache_control_hint({"type": "ephemeral", "ttl": ["1h"]}), "cache_control.ttl"),
    (lambda: openai_hint("", None), "prompt_cache_key"),
    (lambda: openai_hint(7, None), "prompt_cache_key"),
    (lambda: cache_control_hint({"type": "persistent"}), "cache_control.type"),
    (lambda: cache_control_hint({"type": "ephemeral", "ttl": "2h"}), "cache_control.ttl"),
    (lambda: cache_control_hint({"type": "ephemeral", "pin": True}), "cache_control.pin"),
    (lambda: cache_control_hint("ephemeral", "messages[1].cache_control"),
     "messages[1].cache_control.type"),
])
def test_bad_hint_values_name_their_field(call, field):
    with pytest.raises(HintError) as caught:
        call()
    assert caught.value.field == field
    assert str(caught.value).startswith(field)


def test_anthropic_ttl_defaults_to_five_minutes_and_the_longest_hint_wins():
    short = cache_control_hint({"type": "ephemeral"})
    long = cache_control_hint({"type": "ephemeral", "ttl": "1h"})
    assert short.retention_s == 300.0
    assert strongest([short, None, openai_hint("k", None), long]) == CacheHint(3600.0, "k",
                                                                              "cache_control")


def _book(share: float, capacity: int = 40, policy: str = "shadow") -> tuple[RadixIndex, HintBook]:
    index = RadixIndex(1, capacities={"device": capacity}, policies={"device": policy})
    counts: dict[str, int] = {}
    book = HintBook(index, share, lambda k, n: counts.__setitem__(k, counts.get(k, 0) + n),
                    tiers=("device",))
    book.counts = counts  # type: ignore[attr-defined]
    return index, book


def _put(index: RadixIndex, first: int, pages: int) -> list:
    data = b"".join(i.to_bytes(4, "little") for i in range(first, first + pages))
    index.insert(data, tier="device", ids=index.allocate("device", pages))
    return [node for node, _ in index.match(data).path]


def test_a_tenant_gets_at_most_its_share_and_the_rest_is_counted():
    index, book = _book(share=0.25, capacity=40)            # 10 pages per tenant
    book.observe(0, 0.0)
    book.observe(100, 60.0)                                  # 100 new pages a minute
    outcome = book.apply(_put(index, 1, 8), CacheHint(300.0), b"a", 61.0)
    assert (outcome.applied_pages, outcome.refused_pages) == (8, 0)
    assert outcome.head_start_pages == pytest.approx(300.0 * 100 / 60)
    second = book.apply(_put(index, 100, 8), CacheHint(300.0), b"a", 62.0)
    assert (second.applied_pages, second.refused_pages) == (0, 8)
    other = book.apply(_put(index, 200, 8), CacheHint(300.0), b"b", 62.0)
    assert other.applied_pages == 8                          # another tenant has its own share
    assert book.counts["hint_pages_refused_total"] == 8


def test_a_hint_expires_after_its_retention_and_the_head_start_goes():
    index, book = _book(share=1.0)
    book.observe(0, 0.0)
    book.observe(600, 60.0)
    hinted = _put(index, 1, 4)
    book.apply(hinted, CacheHint(300.0), b"", 60.0)
    policy = index.ledgers[0].policy
    assert all(policy._runs[n].boost > 0 for n in hinted)
    book.expire(359.0)
    assert book.hinted_pages() == 4
    book.expire(361.0)
    assert book.hinted_pages() == 0
    assert all(policy._runs[n].boost == 0 for n in hinted)


def test_hints_on_a_policy_without_boost_are_ignored_and_counted():
    index, book = _book(share=0.25, policy="lru")
    outcome = book.apply(_put(index, 1, 4), CacheHint(300.0), b"", 1.0)
    assert outcome.applied_pages == 0
    assert book.counts["hint_ignored_total"] == 1


def test_trace_lines_carry_hints_and_reject_bad_ones_naming_the_line():
    trace = parse_lines(['{"timestamp": 1, "input_length": 512, "hash_ids": [1],'
                         ' "prompt_cache_retention": "24h", "tenant": "t"}'])
    assert trace.requests[0].hint.retention_s == 86_400.0
    assert trace.requests[0].tenant == "t"
    again = parse_lines([trace.requests[0].to_json()])
    assert again.requests[0] == trace.requests[0]
    with pytest.raises(ConfigError, match="line 1.*cache_control.ttl"):
        parse_lines(['{"timestamp": 1, "input_length": 512, "hash_ids": [1],'
                     ' "cache_control": {"type": "ephemeral", "ttl": "9m"}}'])


def _hinted_share(trace, result) -> float:
    rows = [result.per_request[i] for i, r in enumerate(trace.requests) if r.hint is not None]
    return sum(sum(row[1:]) for row in rows) / sum(row[0] for row in rows)


def test_hinted_documents_survive_a_flood_that_lru_lets_push_them_out():
    trace = synthetic.hinted(synthetic.Shape(requests=1500, duration_s=900))
    config = ReplayConfig(300 * trace.block_tokens, policy="shadow")
    hinted = replay(trace, config)
    unhinted = replay(trace, ReplayConfig(300 * trace.block_tokens, policy="shadow",
                                          hint_share=0.0))
    lru = replay(trace, ReplayConfig(300 * trace.block_tokens, policy="lru"))
    assert _hinted_share(trace, lru) < 0.05
    assert _hinted_share(trace, unhinted) < 0.05
    assert _hinted_share(trace, hinted) > 0.5
    assert hinted.hints["hint_pages_applied_total"] > 0


def test_a_timed_replay_honours_hints_as_an_untimed_one_does():
    trace = synthetic.hinted(synthetic.Shape(requests=600, duration_s=400))
    config = ReplayConfig(300 * trace.block_tokens, policy="shadow")
    plain, timed = replay(trace, config), replay(trace, config, timed=True)
    assert plain.hints["hint_pages_applied_total"] > 0
    assert timed.served_tokens == plain.served_tokens
    assert timed.hints == plain.hints
