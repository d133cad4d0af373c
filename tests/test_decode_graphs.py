"""Captured batched decode, its bookkeeping on the CPU: the static steps run eagerly in place of
the graphs (``capture=False``) and must give the batched forward's logits and KV, pad to buckets
through a scratch page only, and fall back (counted) to the eager step on any failure."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine import decode_graphs, paged
from kvtier.engine.decode_graphs import DecodeGraphs, bucket_for, width_for
from kvtier.engine.request import GenerationRequest
from test_engine_batching import PROMPTS, _run, _service
from test_engine_support import tiny_lm

PAGE, SCRATCH = 8, 39


def _pool(lm, pages: int = 40) -> torch.Tensor:
    layout = lm.kv_layout(PAGE)
    gen = torch.Generator().manual_seed(1)
    return torch.randn(layout.num_layers, 2, pages, PAGE, layout.num_kv_heads, layout.head_dim,
                       generator=gen)


def _rows(lengths=(29, 6, 17)) -> list[paged.BatchRow]:
    """Decode rows over scattered pages (the scratch page never among them)."""
    order = torch.randperm(SCRATCH, generator=torch.Generator().manual_seed(2)).tolist()
    rows, used = [], 0
    for i, past in enumerate(lengths):
        count = -(-(past + 1) // PAGE)
        rows.append(paged.BatchRow(order[used:used + count], past, [11 + i]))
        used += count
    return rows


def test_buckets_are_powers_of_two_up_to_the_largest_and_widths_cover_the_past():
    assert [bucket_for(n, 64) for n in (1, 2, 3, 5, 16, 17, 64)] == [1, 2, 4, 8, 16, 32, 64]
    assert bucket_for(65, 64) is None and bucket_for(3, 2) is None
    assert width_for(30, 8) == decode_graphs.CHUNK_TOKENS // 8      # at least one chunk
    assert width_for(5000, 64) == 8192 // 64
    assert width_for(4096, 64) == 4096 // 64


def test_the_chunk_matches_the_split_kernels():
    paged_split = pytest.importorskip("kvtier.engine.paged_split")
    assert decode_graphs.CHUNK_TOKENS == paged_split.CHUNK_TOKENS


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_padded_static_step_gives_the_batched_forwards_logits_and_kv(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    lm, rows = tiny_lm(), _rows()
    eager_pool, graph_pool = _pool(lm), _pool(lm)
    want = paged.forward_batch(lm, rows, eager_pool, "torch")
    graphs = DecodeGraphs(lm, 8, lambda: SCRATCH, capture=False, backend=backend)
    got = graphs.run(rows, graph_pool)
    assert got is not None and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    real = list(range(SCRATCH))
    torch.testing.assert_close(graph_pool[:, :, real], eager_pool[:, :, real], rtol=1e-5,
                               atol=1e-5)
    assert graphs.stats()["graphs"] == [(4, width_for(30, PAGE))] and graphs.served == 1


def test_padding_rows_write_only_the_scratch_page():
    lm = tiny_lm()
    pool = _pool(lm)
    before = pool.clone()
    graphs = DecodeGraphs(lm, 8, lambda: SCRATCH, capture=False, backend="torch")
    steps = [_rows((12,)), _rows((12, 3)), _rows((20, 3, 9))]   # buckets 1, 2, 4 (one pad)
    for rows in steps:
        graphs.run(rows, pool)
    touched = {p for rows in steps for row in rows for p in row.pages}
    untouched = [p for p in range(pool.shape[2]) if p not in touched and p != SCRATCH]
    assert untouched and torch.equal(pool[:, :, untouched], before[:, :, untouched])
    assert not torch.equal(pool[:, :, SCRATCH], before[:, :, SCRATCH])   # padding went there
    assert graphs.stats()["graphs"] == [(1, 32), (2, 32), (4, 32)]


def test_warming_builds_every_bucket_once_and_steps_reuse_them(monkeypatch):
    lm = tiny_lm()
    pool = _pool(lm)
    graphs = DecodeGraphs(lm, 8, lambda: SCRATCH, capture=False, backend="torch")
    assert graphs.warm(pool, 30) == 4      # buckets 1, 2, 4, 8 at one width
    assert graphs.stats()["graphs"] == [(b, width_for(30, PAGE)) for b in (1, 2, 4, 8)]
    monkeypatch.setattr(graphs, "_build", lambda *a: pytest.fail("built again"))
    assert graphs.run(_rows(), pool) is not None and graphs.warm(pool, 30) == 4


def test_steps_a_graph_cannot_serve_run_eagerly():
    lm = tiny_lm()
    graphs = DecodeGraphs(lm, 2, lambda: SCRATCH, capture=False, backend="torch")
    pool = _pool(lm)
    prefill = [paged.BatchRow([0, 1], 0, [5, 6, 7])]
    assert graphs.run(prefill, pool) is None and not graphs.fallbacks
    assert graphs.run(_rows(), pool) is None                     # 3 rows > 2
    loading = [paged.BatchRow([0], 3, [5], ticket=object())]
    assert graphs.run(loading, pool) is None
    assert graphs.fallbacks == {"batch_too_large": 1, "loading": 1}
    assert graphs.served == 0 and graphs.disabled is None


def test_a_failed_capture_turns_the_graphs_off_counted(monkeypatch):
    lm = tiny_lm()
    graphs = DecodeGraphs(lm, 8, lambda: SCRATCH, capture=True, backend="torch")

    def broken(step):
        raise RuntimeError("capture failed")
    monkeypatch.setattr(graphs, "_capture", broken)
    assert graphs.run(_rows(), _pool(lm)) is None
    assert graphs.fallbacks["capture_failed"] == 1 and "capture failed" in graphs.disabled
    assert graphs.run(_rows(), _pool(lm)) is None and graphs.fallbacks["capture_failed"] == 1


def test_a_failed_replay_turns_the_graphs_off_and_the_step_runs_eagerly(monkeypatch):
    lm = tiny_lm()
    graphs = DecodeGraphs(lm, 8, lambda: SCRATCH, capture=False, backend="torch")
    pool = _pool(lm)
    assert graphs.run(_rows(), pool) is not None
    monkeypatch.setattr(decode_graphs.StaticDecode, "fill",
                        lambda self, rows: (_ for _ in ()).throw(RuntimeError("bad fill")))
    assert graphs.run(_rows(), pool) is None
    assert graphs.fallbacks["replay_failed"] == 1 and not graphs.stats()["graphs"]


def test_no_scratch_page_turns_the_graphs_off_counted():
    lm = tiny_lm()

    def exhausted():
        raise MemoryError("no page")
    graphs = DecodeGraphs(lm, 8, exhausted, capture=False, backend="torch")
    assert graphs.run(_rows(), _pool(lm)) is None
    assert graphs.fallbacks["no_memory"] == 1 and graphs.disabled.startswith("no_memory")


@pytest.mark.parametrize("cache", ["false", "true"])
def test_the_engine_serves_decodes_from_the_graphs_with_the_eager_tokens(cache):
    flags = {"engine.prefill_chunk_tokens": 1000, "cache.enabled": cache}
    eager = _service(6, **flags)
    try:
        want = _run(eager, PROMPTS, 8)
    finally:
        eager.close()
    served = _service(6, **flags)
    try:
        graphs = DecodeGraphs(served.lm, 8, served.engine.pages.scratch_page, capture=False,
                              backend="torch")
        served.engine.decode_graphs = graphs
        got = _run(served, PROMPTS, 8)
        stats = served.engine.stats()["decode_graphs"]
        handle = served.submit(GenerationRequest(tuple(PROMPTS[0]), 3))
        assert handle.result(timeout=300)[1].reason == "length"
    finally:
        served.close()
    assert got == want
    assert stats["served"] >= 7 and stats["graphs"] == [(8, width_for(90, 16))]
