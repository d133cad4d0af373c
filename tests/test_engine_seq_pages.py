"""Page tables of the batched engine over the tiered cache: a prompt cached whole runs its last
token in a private copy of its last page, or recomputes that page when the pool has none."""

from __future__ import annotations

import pytest

from kvtier.engine.prefix import PrefixCache
from kvtier.engine.request import PrefillReport
from kvtier.engine.seq_pages import CachedPages
from test_engine_cache_matrix import through
from test_engine_prefix import _prompt
from test_engine_support import make_config, tiny_lm


@pytest.fixture
def cached():
    prefix_cache = PrefixCache.build(make_config(cache__device_pages=8), tiny_lm())
    prompt = _prompt(64, 3)
    through(prefix_cache, prompt)
    yield CachedPages(prefix_cache), prompt
    prefix_cache.close()


def test_a_prompt_cached_whole_copies_its_last_page_before_running_its_last_token(cached):
    pages, prompt = cached
    hit_pages = pages.tiered.match(prompt).device_page_ids
    table, held = pages.open(prompt, None, PrefillReport(64))
    assert held == 63 and len(table.table) == 4
    assert table.table[:3] == hit_pages[:3] and table.table[3] not in hit_pages
    kv = pages.kv
    assert bool((kv[:, :, table.table[3]] == kv[:, :, hit_pages[3]]).all())
    pages.close(table, [], commit=False)
    pages.tiered.check_integrity()


def test_without_a_free_page_the_last_page_is_recomputed_instead(cached):
    pages, prompt = cached
    hog = pages.tiered.allocate(pages.tiered.device_pool.allocator.num_free)
    report = PrefillReport(64)
    table, held = pages.open(prompt, None, report)
    assert held == 48 and len(table.table) == 3 and report.cached_tokens == 48
    pages.close(table, [], commit=False)
    pages.tiered.free(hog)
    pages.tiered.check_integrity()
