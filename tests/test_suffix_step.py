"""The captured suffix step of a lone hit, its bookkeeping on the CPU: the static steps run
eagerly in place of the graphs (``capture=False``) and must give the batched forward's logits
and KV (the same paged attention, so a captured hit computes what an eager one does), write
padding to the scratch page only, wait for each layer's host copy before that layer, and fall
back (counted) to the eager step on any failure."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine import paged, suffix_step
from kvtier.engine.suffix_step import SuffixStep, bucket_for
from test_engine_support import tiny_lm

PAGE, SCRATCH = 8, 39


def _pool(lm, pages: int = 40) -> torch.Tensor:
    layout = lm.kv_layout(PAGE)
    gen = torch.Generator().manual_seed(1)
    return torch.randn(layout.num_layers, 2, pages, PAGE, layout.num_kv_heads, layout.head_dim,
                       generator=gen)


def _row(past: int = 24, new: int = 5, ticket=None) -> paged.BatchRow:
    """A suffix row over scattered pages (the scratch page never among them)."""
    order = torch.randperm(SCRATCH, generator=torch.Generator().manual_seed(2)).tolist()
    pages = order[:-(-(past + new) // PAGE)]
    return paged.BatchRow(pages, past, [11 + i for i in range(new)], ticket)


def test_buckets_cover_one_to_the_largest_and_the_block_rows_match_the_kernel():
    assert [bucket_for(n) for n in (1, 8, 9, 33, 128)] == [8, 8, 16, 64, 128]
    paged_triton = pytest.importorskip("kvtier.engine.paged_triton")
    assert suffix_step.MAX_ROWS == paged_triton.MAX_ROWS


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("past,new", [(24, 5), (29, 13)])
def test_a_padded_static_suffix_gives_the_batched_forwards_logits_and_kv(backend, past, new):
    if backend == "triton":
        pytest.importorskip("triton")
    lm, row = tiny_lm(), _row(past, new)
    eager_pool, graph_pool = _pool(lm), _pool(lm)
    want = paged.forward_batch(lm, [row], eager_pool, "torch")
    step = SuffixStep(lm, 256, lambda: SCRATCH, capture=False, backend=backend)
    got = step.run(row, graph_pool)
    assert got is not None and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    real = list(range(SCRATCH))
    torch.testing.assert_close(graph_pool[:, :, real], eager_pool[:, :, real], rtol=1e-5,
                               atol=1e-5)
    assert step.stats()["buckets"] == [bucket_for(new)] and step.served == 1


def test_padding_writes_only_the_scratch_page_and_buckets_are_reused(monkeypatch):
    lm = tiny_lm()
    pool = _pool(lm)
    before = pool.clone()
    step = SuffixStep(lm, 256, lambda: SCRATCH, capture=False, backend="torch")
    assert step.warm(pool) == len(suffix_step.BUCKETS)
    monkeypatch.setattr(step, "_build", lambda *a: pytest.fail("built again"))
    row = _row(16, 3)
    assert step.run(row, pool) is not None
    untouched = [p for p in range(pool.shape[2]) if p not in row.pages and p != SCRATCH]
    assert untouched and torch.equal(pool[:, :, untouched], before[:, :, untouched])
    assert not torch.equal(pool[:, :, SCRATCH], before[:, :, SCRATCH])   # padding went there


def test_each_layer_waits_for_its_own_host_copy_first(monkeypatch):
    lm = tiny_lm()
    order: list[tuple[str, int]] = []

    class Ticket:
        def stream_wait(self, layer=None):
            order.append(("wait", layer))
    step = SuffixStep(lm, 256, lambda: SCRATCH, capture=False, backend="torch")
    original = suffix_step.StaticSuffix.write

    def write(self, layer, key, value):
        order.append(("layer", layer))
        original(self, layer, key, value)
    monkeypatch.setattr(suffix_step.StaticSuffix, "write", write)
    assert step.run(_row(ticket=Ticket()), _pool(lm)) is not None
    layers = lm.config.num_hidden_layers
    assert order == [(kind, i) for i in range(layers) for kind in ("wait", "layer")]


def test_pasts_past_the_capacity_run_eagerly_counted():
    lm = tiny_lm()
    step = SuffixStep(lm, 128, lambda: SCRATCH, capture=False, backend="torch")
    assert step.run(_row(128, 5), _pool(lm, 60)) is None
    assert step.fallbacks == {"too_long": 1} and step.disabled is None


def test_a_failed_capture_or_replay_turns_the_graphs_off_counted(monkeypatch):
    lm = tiny_lm()
    step = SuffixStep(lm, 256, lambda: SCRATCH, capture=True, backend="torch")
    monkeypatch.setattr(step, "_capture", lambda steps: (_ for _ in ()).throw(
        RuntimeError("capture failed")))
    assert step.run(_row(), _pool(lm)) is None
    assert step.fallbacks["capture_failed"] == 1 and "capture failed" in step.disabled
    replaying = SuffixStep(lm, 256, lambda: SCRATCH, capture=False, backend="torch")
    pool = _pool(lm)
    assert replaying.run(_row(), pool) is not None
    monkeypatch.setattr(suffix_step.StaticSuffix, "fill",
                        lambda self, row: (_ for _ in ()).throw(RuntimeError("bad fill")))
    assert replaying.run(_row(), pool) is None
    assert replaying.fallbacks["replay_failed"] == 1 and not replaying.stats()["buckets"]


def test_no_scratch_page_turns_the_graphs_off_counted():
    lm = tiny_lm()

    def exhausted():
        raise MemoryError("no page")
    step = SuffixStep(lm, 256, exhausted, capture=False, backend="torch")
    assert step.run(_row(), _pool(lm)) is None
    assert step.fallbacks["no_memory"] == 1 and step.disabled.startswith("no_memory")
