"""The batched forward over the device pool: one forward for many sequences, paged attention.

Rows of different lengths, in pages scattered over the pool in any order, mixing prefill chunks
and single decode tokens, must give the logits transformers gives each sequence run alone.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.engine import paged
from test_engine_support import tiny_lm


def _prompt(n: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(5, 1000, (n,), generator=generator).tolist()


def _pool(lm, pages: int, page_size: int) -> torch.Tensor:
    layout = lm.kv_layout(page_size)
    return torch.full((layout.num_layers, 2, pages, page_size, layout.num_kv_heads,
                       layout.head_dim), float("nan"))


def _reference(lm, tokens: list[int]) -> torch.Tensor:
    return lm.forward(torch.tensor(tokens), lm.new_cache(), all_logits=True)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_chunks_and_decodes_in_one_forward_match_each_sequence_alone(name):
    lm, page = tiny_lm(name), 8
    pool = _pool(lm, 40, page)
    prompts = [_prompt(29, 1), _prompt(5, 2), _prompt(17, 3)]
    tables = [[31, 2, 17, 9], [5], [0, 38, 11]]     # scattered, out of order
    # step 1: the first prompt in two chunks (13, then 16 in step 2), the others whole
    rows = [paged.BatchRow(tables[0], 0, prompts[0][:13]),
            paged.BatchRow(tables[1], 0, prompts[1]), paged.BatchRow(tables[2], 0, prompts[2])]
    first = paged.forward_batch(lm, rows, pool)
    rows = [paged.BatchRow(tables[0], 13, prompts[0][13:]),
            paged.BatchRow(tables[1], 5, [7]), paged.BatchRow(tables[2], 17, [9])]
    second = paged.forward_batch(lm, rows, pool)
    want = [_reference(lm, p) for p in (prompts[0], prompts[1] + [7], prompts[2] + [9])]
    torch.testing.assert_close(first[0], _reference(lm, prompts[0][:13])[-1], rtol=0, atol=1e-5)
    torch.testing.assert_close(first[1], want[1][4], rtol=0, atol=1e-5)
    torch.testing.assert_close(first[2], want[2][16], rtol=0, atol=1e-5)
    for got, ref in zip(second, want, strict=True):
        torch.testing.assert_close(got, ref[-1], rtol=0, atol=1e-5)


def test_a_row_whose_pages_cannot_hold_its_tokens_is_refused():
    lm = tiny_lm()
    with pytest.raises(ValueError, match="cannot hold"):
        paged.forward_batch(lm, [paged.BatchRow([0], 0, _prompt(9))], _pool(lm, 4, 8))


def test_outside_a_batch_the_model_runs_its_previous_attention():
    lm = tiny_lm()
    assert lm.model.config._attn_implementation.startswith(paged.NAME)
    tokens = _prompt(20)
    split = lm.new_cache()
    lm.forward(torch.tensor(tokens[:12]), split)
    torch.testing.assert_close(lm.forward(torch.tensor(tokens[12:]), split),
                               _reference(lm, tokens)[-1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("page", [4, 16])
def test_the_triton_kernel_matches_the_torch_path(page):
    """Run under TRITON_INTERPRET=1 on the CPU (the kernel itself, no GPU needed)."""
    lm = tiny_lm()
    pool = torch.randn(lm.kv_layout(page).num_layers, 2, 48, page, lm.num_kv_heads, lm.head_dim)
    order = torch.randperm(48, generator=torch.Generator().manual_seed(page)).tolist()
    spans = [(30, 7), (17, 1), (0, 11)]   # (past, new): a chunk after a past, a decode, a prompt
    rows, used = [], 0
    for start, new in spans:
        count = -(-(start + new) // page)
        rows.append(paged.BatchRow(order[used:used + count], start, _prompt(new, start)))
        used += count
    heads = lm.config.num_attention_heads
    query = torch.randn(1, heads, 19, lm.head_dim)
    torch_batch = paged.PagedBatch(rows, pool, "torch")
    triton_batch = paged.PagedBatch(rows, pool, "triton")
    for layer in (0, 3):
        want = torch_batch.attend(layer, query, 0.17)
        got = triton_batch.attend(layer, query, 0.17)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_whole_forward_with_the_triton_kernel_gives_the_torch_paths_logits():
    lm, page = tiny_lm(), 8
    rows = [paged.BatchRow([3, 1, 6], 0, _prompt(19, 5)), paged.BatchRow([0, 4], 0, _prompt(9, 6))]
    logits = {}
    for backend in ("torch", "triton"):
        pool = _pool(lm, 8, page)
        first = paged.forward_batch(lm, rows, pool, backend)
        decode = [paged.BatchRow(r.pages, r.end, [11]) for r in rows]
        logits[backend] = torch.cat([first, paged.forward_batch(lm, decode, pool, backend)])
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=0, atol=1e-4)


def test_decodes_of_different_lengths_never_read_other_pages():
    """Unused slots hold NaN here: padding a short row up to the longest must not read them."""
    lm, page = tiny_lm(), 8
    pool = _pool(lm, 12, page)
    prompts = {9: _prompt(3, 7), 2: _prompt(21, 8)}
    for pid, prompt in prompts.items():
        paged.forward_batch(lm, [paged.BatchRow([pid, pid + 1, pid + 5][:-(-21 // page)], 0,
                                                prompt)], pool)
    rows = [paged.BatchRow([9], 3, [4]), paged.BatchRow([2, 3, 7], 21, [4])]
    got = paged.forward_batch(lm, rows, pool)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got[0], _reference(lm, prompts[9] + [4])[-1], rtol=0, atol=1e-5)


class RecordingTicket:
    """Stands in for a per-layer host -> device copy: records which layer was waited for."""

    def __init__(self, pool: torch.Tensor, layers_landed: list[int]) -> None:
        self.pool, self.waits, self.landed = pool, [], layers_landed

    def stream_wait(self, stream=None, layer=None) -> None:
        self.waits.append(layer)
        self.landed.append(layer)


def test_a_row_still_loading_waits_for_each_layer_before_reading_it(monkeypatch):
    lm, page = tiny_lm(), 8
    pool = _pool(lm, 6, page)
    prompt = _prompt(16, 9)
    paged.forward_batch(lm, [paged.BatchRow([4, 1], 0, prompt)], pool)
    landed: list[int] = []
    ticket = RecordingTicket(pool, landed)
    reads: list[tuple[int, list[int]]] = []
    attend = paged.PagedBatch.attend

    def spy(self, layer, query, scaling):
        reads.append((layer, list(landed)))
        return attend(self, layer, query, scaling)
    monkeypatch.setattr(paged.PagedBatch, "attend", spy)
    got = paged.forward_batch(lm, [paged.BatchRow([4, 1, 0], 16, [5], ticket),
                                   paged.BatchRow([2], 0, [7, 8])], pool)
    assert ticket.waits == list(range(lm.config.num_hidden_layers))
    assert all(layer in seen and layer + 1 not in seen for layer, seen in reads)
    torch.testing.assert_close(got[0], _reference(lm, prompt + [5])[-1], rtol=0, atol=1e-5)


def test_a_prompts_last_token_stepped_alone_attends_as_a_prompt_row(monkeypatch):
    """A prompt's last token computed alone (after a chunk or a hit) takes the prompt kernels,
    as in the whole prompt; only generated tokens are decodes."""
    from kvtier.engine.request import GenerationRequest
    from kvtier.engine.service import EngineService
    from test_engine_support import make_config

    seen: list[tuple[int, int, bool, bool]] = []
    original = paged.forward_batch

    def spy(lm, rows, pool, *args, **kwargs):
        seen.extend((row.start, len(row.tokens), row.prompt, row.decode) for row in rows)
        return original(lm, rows, pool, *args, **kwargs)

    monkeypatch.setattr(paged, "forward_batch", spy)
    config = make_config(**{"engine.prefill_chunk_tokens": 8, "cache.enabled": "false"})
    service = EngineService.build(config, lm=tiny_lm(), max_running=2)
    try:
        service.generate(GenerationRequest(tuple(range(20, 29)), 3), timeout=120)
    finally:
        service.close()
    assert seen[:2] == [(0, 8, True, False), (8, 1, True, False)]     # 9 tokens, chunks of 8
    assert seen[2:] == [(9, 1, False, True), (10, 1, False, True)]    # the generated ones
    assert paged.BatchRow([0], 3, [7]).decode                         # the default: a decode
