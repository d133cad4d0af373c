"""The FlashAttention 3 backend's plumbing on the CPU, and when it is chosen.

FA3 itself needs a Hopper GPU (``tests/test_paged_fa3_gpu.py`` runs it there). Here its varlen
entry is replaced by a PyTorch function with the semantics FA3 documents for these arguments
(segments ``cu_seqlens_q``, keys ``seqused_k`` through ``block_table``, the causal mask aligned
bottom-right, a row with no keys all zeros), so what is checked is what kvtier hands it: the
segments of a step's rows, decode rows left to the split-KV kernel, the captured suffix step's
static arguments, and that every prompt-shaped path of one model takes the same backend.
"""

from __future__ import annotations

import logging

import pytest
import torch

from kvtier.engine import paged, paged_fa3, paged_fa3_plan
from kvtier.engine.suffix_step import SuffixStep
from test_engine_support import tiny_lm


def fa3_semantics(q, k, v, max_q, cu_q, max_k, *, seqused_k, block_table, causal,
                  softmax_scale, num_splits, out=None, return_softmax_lse=False):
    """What FA3's ``flash_attn_varlen_func`` computes for paged keys, in PyTorch: each entry's
    output (normalized over its keys) and log-sum-exp (natural log, ``[heads, tokens]``)."""
    assert num_splits == 1      # the numerics contract's setting
    page = k.shape[1]
    out = torch.zeros_like(q) if out is None else out
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"))
    for i in range(cu_q.shape[0] - 1):
        first, last, keys = int(cu_q[i]), int(cu_q[i + 1]), int(seqused_k[i])
        n = last - first
        assert n <= max_q and keys <= max_k
        if n == 0:
            continue
        if keys == 0:
            out[first:last] = 0
            continue
        slots = (block_table[i].long()[:, None] * page + torch.arange(page)).reshape(-1)[:keys]
        keys_ = k.reshape(-1, *k.shape[2:])[slots].transpose(0, 1).float()
        values = v.reshape(-1, *v.shape[2:])[slots].transpose(0, 1).float()
        rep = q.shape[1] // k.shape[2]
        keys_, values = keys_.repeat_interleave(rep, 0), values.repeat_interleave(rep, 0)
        scores = q[first:last].transpose(0, 1).float() @ keys_.transpose(1, 2) * softmax_scale
        if causal:
            visible = torch.arange(keys)[None, :] <= torch.arange(keys - n, keys)[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
        lse[:, first:last] = torch.logsumexp(scores, -1)
        out[first:last] = (scores.softmax(-1) @ values).transpose(0, 1).to(out.dtype)
    return (out, lse) if return_softmax_lse else out


@pytest.fixture
def fa3(monkeypatch):
    monkeypatch.setattr(paged_fa3, "_KERNEL", fa3_semantics)


def _prompt(n: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(5, 1000, (n,), generator=generator).tolist()


def _step(lm, page: int, spans: list[tuple[int, int]], seed: int):
    """A random pool of 48 pages and one row per (past, new) span in scattered pages (a span
    of one new token is a decode)."""
    pool = torch.randn(lm.kv_layout(page).num_layers, 2, 48, page, lm.num_kv_heads, lm.head_dim)
    order = torch.randperm(48, generator=torch.Generator().manual_seed(seed)).tolist()
    rows, used = [], 0
    for start, new in spans:
        count = -(-(start + new) // page)
        rows.append(paged.BatchRow(order[used:used + count], start, _prompt(new, start)))
        used += count
    return pool, rows


def test_a_step_of_chunks_decodes_and_prompts_attends_as_the_torch_path(fa3):
    pytest.importorskip("triton")   # decode rows: the split-KV kernel, interpreted
    lm = tiny_lm()
    # a decode first, a chunk after a past, another decode, a prompt: segments in any order
    pool, rows = _step(lm, 8, [(12, 1), (30, 7), (17, 1), (0, 11)], 3)
    query = torch.randn(1, lm.config.num_attention_heads, 20, lm.head_dim)
    want_batch = paged.PagedBatch(rows, pool, "torch")
    got_batch = paged.PagedBatch(rows, pool, "fa3")
    plan = got_batch.triton.fa3
    assert plan.own.cu_q.tolist() == [0, 1, 8, 9, 20]
    assert plan.own.seqused.tolist() == [0, 37, 0, 11]      # decode rows read nothing here
    assert plan.own.max_q == 11 and plan.passes == []       # no row past the first cut
    for layer in (0, 3):
        torch.testing.assert_close(got_batch.attend(layer, query, 0.17),
                                   want_batch.attend(layer, query, 0.17), rtol=1e-5, atol=1e-5)


def test_a_whole_forward_through_fa3_gives_the_torch_paths_logits(fa3):
    pytest.importorskip("triton")
    lm, page = tiny_lm(), 8
    rows = [paged.BatchRow([3, 1, 6], 0, _prompt(19, 5)), paged.BatchRow([0, 4], 0, _prompt(9, 6))]
    logits = {}
    for backend in ("torch", "fa3"):
        pool = torch.full((lm.kv_layout(page).num_layers, 2, 8, page, lm.num_kv_heads,
                           lm.head_dim), float("nan"))
        first = paged.forward_batch(lm, rows, pool, backend)
        decode = [paged.BatchRow(r.pages, r.end, [11]) for r in rows]
        logits[backend] = torch.cat([first, paged.forward_batch(lm, decode, pool, backend)])
    torch.testing.assert_close(logits["fa3"], logits["torch"], rtol=0, atol=1e-4)


@pytest.mark.parametrize("past,new", [(24, 5), (29, 13)])
def test_the_static_suffix_step_through_fa3_gives_the_batched_forwards_logits(fa3, past, new):
    lm, page, scratch = tiny_lm(), 8, 39
    layout = lm.kv_layout(page)
    pool = torch.randn(layout.num_layers, 2, 40, page, layout.num_kv_heads, layout.head_dim,
                       generator=torch.Generator().manual_seed(1))
    eager_pool, step_pool = pool.clone(), pool.clone()
    pages = torch.randperm(scratch, generator=torch.Generator().manual_seed(2)).tolist()
    row = paged.BatchRow(pages[:-(-(past + new) // page)], past, [11 + i for i in range(new)])
    want = paged.forward_batch(lm, [row], eager_pool, "torch")
    step = SuffixStep(lm, 256, lambda: scratch, capture=False, backend="fa3")
    got = step.run(row, step_pool)
    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    static = next(iter(step._entries.values()))[0]
    assert static.fa3.plan.own.cu_q.tolist() == [0, new, new]
    assert static.fa3.plan.own.seqused.tolist() == [past + new, 0]


@pytest.fixture
def short_cuts(monkeypatch):
    """Segments of 16 keys (pages of 8) and passes of at most 10 partials: every cut, pass
    boundary and merge of a long prompt, at test sizes."""
    monkeypatch.setattr(paged_fa3_plan, "SEGMENT_TOKENS", 16)
    monkeypatch.setattr(paged_fa3_plan, "PASS_PARTIALS", 10)


def test_a_row_is_cut_at_fixed_key_positions_whatever_its_step(short_cuts):
    row = paged.BatchRow(list(range(100, 107)), 20, [1] * 30)         # positions 20 .. 49
    plan = paged_fa3_plan.plan_step([paged.BatchRow([9], 3, [1]), row], [0, 1], 8,
                                    torch.device("cpu"))
    assert plan.segment == 16
    # its own segments: 20..31 over keys 16..31, 32..47 over 32..47, 48..49 over 48..49
    assert plan.own.cu_q.tolist() == [0, 1, 13, 29, 31]
    assert plan.own.seqused.tolist() == [0, 16, 16, 2]
    assert plan.own.table[1:, :2].tolist() == [[102, 103], [104, 105], [106, 0]]
    # positions 20..31, 32..47 and 48..49 see 1, 2 and 3 full segments behind them:
    # 12 + 32 + 6 = 50 partials, at most 10 a pass, a pass's slices within one segment
    assert [int(p.counts.sum()) for p in plan.passes] == [10, 10, 10, 10, 10]
    assert [p.counts.tolist() for p in plan.passes][1:3] == [[1, 1, 2, 2, 2, 2], [2] * 5]
    folded = torch.cat([p.rows for p in plan.passes])
    assert folded.tolist() == list(range(1, 31))                      # every row once
    for full in plan.passes:
        for entry in range(full.launch.seqused.shape[0]):
            assert full.launch.seqused[entry] == 16                   # a whole segment
        assert full.gather.shape[0] == int(full.counts.sum())


def test_rows_across_cuts_and_passes_attend_over_all_their_keys(fa3, short_cuts):
    pytest.importorskip("triton")   # the merge and the decode rows' kernel, interpreted
    lm = tiny_lm()
    # a prompt, a decode, a chunk, a suffix
    pool, rows = _step(lm, 8, [(0, 45), (40, 1), (20, 30), (56, 7)], 4)
    query = torch.randn(1, lm.config.num_attention_heads, 83, lm.head_dim)
    want = paged.PagedBatch(rows, pool, "torch")
    got = paged.PagedBatch(rows, pool, "fa3")
    assert len(got.triton.fa3.passes) > 1
    for layer in (0, 2):
        torch.testing.assert_close(got.attend(layer, query, 0.2), want.attend(layer, query, 0.2),
                                   rtol=1e-5, atol=1e-5)


def test_the_static_suffix_step_across_a_cut_gives_the_batched_forwards_logits(fa3, short_cuts):
    pytest.importorskip("triton")
    lm, page, scratch = tiny_lm(), 8, 39
    layout = lm.kv_layout(page)
    pool = torch.randn(layout.num_layers, 2, 40, page, layout.num_kv_heads, layout.head_dim,
                       generator=torch.Generator().manual_seed(6))
    pages = torch.randperm(scratch, generator=torch.Generator().manual_seed(7)).tolist()
    step = SuffixStep(lm, 256, lambda: scratch, capture=False, backend="fa3")
    for past, new in ((40, 13), (64, 5)):        # across the cut at 48; four segments behind
        row = paged.BatchRow(pages[:-(-(past + new) // page)], past, [11 + i for i in range(new)])
        want = paged.forward_batch(lm, [row], pool.clone(), "torch")
        got = step.run(row, pool.clone())
        assert got is not None
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    static = step._entries[8][0]
    full = static.fa3.plan.passes[0]
    assert full.launch.cu_q.shape[0] == 256 // 16 - 1 + 1                  # static entries
    assert full.counts.tolist() == [4] * 5 + [0] * 3                       # padding: kept


def test_the_merge_folds_segments_as_one_softmax_and_leaves_other_rows():
    pytest.importorskip("triton")
    from kvtier.engine import paged_fa3_merge

    gen = torch.Generator().manual_seed(8)
    heads, dim, tokens, parts = 6, 16, 5, 7
    out = torch.randn(tokens, heads, dim, generator=gen)
    lse = torch.randn(heads, tokens, generator=gen) * 3
    part = torch.randn(parts, heads, dim, generator=gen)
    part_lse = torch.randn(heads, parts, generator=gen) * 3
    rows = torch.tensor([4, 1, 2], dtype=torch.int32)
    index = torch.tensor([[6, 0, 3], [2, 5, 0], [0, 0, 0]], dtype=torch.int32)
    counts = torch.tensor([3, 1, 0], dtype=torch.int32)
    want = out.clone()
    for row, ids, n in zip(rows.tolist(), index.tolist(), counts.tolist(), strict=True):
        if n:
            lses = torch.cat([part_lse[:, ids[:n]], lse[:, row:row + 1]], 1)     # [heads, n+1]
            values = torch.cat([part[ids[:n]], out[row:row + 1]]).transpose(0, 1)
            want[row] = (lses.softmax(1)[:, :, None] * values).sum(1)
    got = out.clone()
    paged_fa3_merge.merge(got, lse, part, part_lse, rows, index, counts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[2], out[2]) and torch.equal(got[0], out[0])   # count 0, not listed
    with pytest.raises(ValueError, match="log-sum-exp"):
        paged_fa3_merge.merge(got, lse.T, part, part_lse, rows, index, counts)


def test_fa3_is_chosen_only_where_it_can_serve(monkeypatch, caplog):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    trial = paged_fa3._refused
    assert paged_fa3.choose("auto", cpu, torch.bfloat16, 128, False)[0] == "torch"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(paged_fa3, "_KERNEL", fa3_semantics)
    monkeypatch.setattr(paged_fa3, "_refused", lambda *args: None)   # the trial launch passed
    assert paged_fa3.choose("auto", cuda, torch.bfloat16, 128, False) == \
        ("fa3", "FlashAttention 3 (vllm.vllm_flash_attn)")
    assert paged_fa3.choose("triton", cuda, torch.bfloat16, 128, False)[0] == "triton"
    for dtype, head_dim, deterministic, why in (
            (torch.float32, 128, False, "bf16/fp16"), (torch.bfloat16, 64, False, "not 64"),
            (torch.float16, 128, True, "deterministic")):
        backend, reason = paged_fa3.choose("auto", cuda, dtype, head_dim, deterministic)
        assert backend == "triton" and why in reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with caplog.at_level(logging.WARNING, logger="kvtier.engine.paged_fa3"):
        assert paged_fa3.choose("fa3", cuda, torch.bfloat16, 128, False)[0] == "triton"
    assert "Hopper" in caplog.text and "not available" in caplog.text
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(paged_fa3, "_KERNEL", False)
    monkeypatch.setattr(paged_fa3, "_MISSING", "vllm.vllm_flash_attn: ModuleNotFoundError")
    assert paged_fa3.choose("auto", cuda, torch.bfloat16, 128, False) == \
        ("triton", "vllm.vllm_flash_attn: ModuleNotFoundError")
    monkeypatch.setattr(paged_fa3, "_KERNEL", fa3_semantics)
    monkeypatch.setattr(paged_fa3, "_refused", trial)
    reason = paged_fa3.choose("auto", cuda, torch.bfloat16, 128, False)[1]   # no CUDA here:
    assert reason.startswith("a trial FA3 launch failed")                   # the trial fails
    with pytest.raises(ValueError, match="prefill_attention"):
        paged_fa3.choose("flash", cuda, torch.bfloat16, 128, False)


def test_one_model_keeps_one_backend_for_every_paged_path(fa3, monkeypatch):
    lm = tiny_lm()                                    # shared by tests: restored after
    monkeypatch.setattr(lm, "paged_backend", None)
    assert paged.backend_of(lm) == "torch"          # on the CPU
    monkeypatch.setattr(lm, "paged_backend", "fa3")  # as load_model would set it on Hopper
    assert paged.backend_of(lm, "triton") == "fa3"   # chosen once, kept
    assert SuffixStep(lm, 256, lambda: 0, capture=False).backend == "fa3"
