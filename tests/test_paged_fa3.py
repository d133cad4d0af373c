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
import torch.nn.functional as F

from kvtier.engine import paged, paged_fa3
from kvtier.engine.suffix_step import SuffixStep
from test_engine_support import tiny_lm


def fa3_semantics(q, k, v, max_q, cu_q, max_k, *, seqused_k, block_table, causal,
                  softmax_scale, num_splits, out):
    """What FA3's ``flash_attn_varlen_func`` computes for paged keys, in PyTorch."""
    assert causal and num_splits == 1      # the numerics contract's settings
    page = k.shape[1]
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
        keys_ = k.reshape(-1, *k.shape[2:])[slots].transpose(0, 1)[None]
        values = v.reshape(-1, *v.shape[2:])[slots].transpose(0, 1)[None]
        visible = torch.arange(keys)[None, :] <= torch.arange(keys - n, keys)[:, None]
        got = F.scaled_dot_product_attention(q[first:last].transpose(0, 1)[None], keys_, values,
                                             attn_mask=visible, scale=softmax_scale,
                                             enable_gqa=True)
        out[first:last] = got[0].transpose(0, 1)
    return out


@pytest.fixture
def fa3(monkeypatch):
    monkeypatch.setattr(paged_fa3, "_KERNEL", fa3_semantics)


def _prompt(n: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(5, 1000, (n,), generator=generator).tolist()


def test_a_step_of_chunks_decodes_and_prompts_attends_as_the_torch_path(fa3):
    pytest.importorskip("triton")   # decode rows: the split-KV kernel, interpreted
    lm, page = tiny_lm(), 8
    pool = torch.randn(lm.kv_layout(page).num_layers, 2, 48, page, lm.num_kv_heads, lm.head_dim)
    order = torch.randperm(48, generator=torch.Generator().manual_seed(3)).tolist()
    # a decode first, a chunk after a past, another decode, a prompt: segments in any order
    spans = [(12, 1), (30, 7), (17, 1), (0, 11)]
    rows, used = [], 0
    for start, new in spans:
        count = -(-(start + new) // page)
        rows.append(paged.BatchRow(order[used:used + count], start, _prompt(new, start)))
        used += count
    query = torch.randn(1, lm.config.num_attention_heads, 20, lm.head_dim)
    want_batch = paged.PagedBatch(rows, pool, "torch")
    got_batch = paged.PagedBatch(rows, pool, "fa3")
    segments = got_batch.triton.fa3
    assert segments.cu_q.tolist() == [0, 1, 8, 9, 20]
    assert segments.seqused.tolist() == [0, 37, 0, 11]      # decode rows read nothing here
    assert (segments.max_q, segments.max_k) == (11, 37)
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
    assert static.cu_q.tolist() == [0, new] and static.seqused.tolist() == [past + new]


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
