"""The flash paged prefill kernel (under TRITON_INTERPRET=1 on the CPU; bit-exact on the GPU in
``tests/test_suffix_step_gpu.py`` and ``tests/test_parity_gpu.py``): it equals plain attention
over the same pages for page sizes 1, 16 and 64 and grouped-query ratios; a prompt computed
whole, in steps of any size and as a hit's suffix (the flash kernel or the split launch) gives
the same bits; a ragged step mixing prompts, chunks and decodes gives each prompt row the bits
it gets alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

paged_triton = pytest.importorskip("kvtier.engine.paged_triton")
from kvtier.engine import paged, paged_prefill_split, paged_tiles  # noqa: E402

DIM, SCALE = 16, 0.25
BLOCK = paged_tiles.BLOCK_N
#: Keys a chunk sums from scratch in these tests: two blocks, so that a few hundred keys cross
#: many chunk boundaries (the engine's 1024 in ``test_the_engines_chunk_size``).
CHUNK = 2 * BLOCK


def _pool(tokens: int, page: int, kv_heads: int, dtype=torch.float32, seed: int = 0):
    """K and V pages for one sequence of ``tokens`` (pages scattered, spare pages around)."""
    gen = torch.Generator().manual_seed(seed)
    pages = -(-tokens // page) + 3
    k = torch.randn(pages, page, kv_heads, DIM, generator=gen).to(dtype)
    v = torch.randn(pages, page, kv_heads, DIM, generator=gen).to(dtype)
    table = torch.randperm(pages, generator=gen)[None].to(torch.int32)
    return k, v, table


def _query(tokens: int, heads: int, dtype=torch.float32, seed: int = 1) -> torch.Tensor:
    return torch.randn(tokens, heads, DIM, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _tiles(start: int, count: int, n_rep: int, q_first: int = 0, seq: int = 0) -> torch.Tensor:
    per = paged_triton.tokens_per_tile(n_rep)
    rows = [(seq, q_first + off, min(per, count - off), start + off)
            for off in range(0, count, per)]
    return torch.as_tensor(rows, dtype=torch.int32)


def _flash(query, k, v, table, start, chunk=CHUNK):
    """``query`` (the tokens at positions ``start ..``) through the flash kernel."""
    n_rep = query.shape[1] // k.shape[2]
    tiles = _tiles(start, query.shape[0], n_rep)
    out = torch.full_like(query, float("nan"))
    return paged_triton.paged_attention(query, k, v, table, tiles, SCALE, int(tiles[:, 2].max()),
                                        out, chunk=chunk)


def _split(query, k, v, table, start, chunk=CHUNK):
    """The same through the split launch (one program per chunk, folded in order)."""
    n_rep = query.shape[1] // k.shape[2]
    tiles = _tiles(start, query.shape[0], n_rep)
    parts = paged_prefill_split.partials(tiles.shape[0], k.shape[2],
                                         -(-(start + query.shape[0]) // chunk), DIM, query.device)
    return paged_prefill_split.split_prefill(query, k, v, table, tiles, SCALE,
                                             torch.full_like(query, float("nan")), parts,
                                             chunk=chunk)


def _steps(query, k, v, table, sizes, chunk=CHUNK):
    """The prompt computed in steps of ``sizes`` tokens (cycled), each over the past."""
    outs, start, i = [], 0, 0
    while start < query.shape[0]:
        count = min(sizes[i % len(sizes)], query.shape[0] - start)
        outs.append(_flash(query[start:start + count], k, v, table, start, chunk))
        start, i = start + count, i + 1
    return torch.cat(outs)


def _reference(query, k, v, table, start):
    page, kv_heads = k.shape[1], k.shape[2]
    count = query.shape[0]
    slots = (table[0].long()[:, None] * page + torch.arange(page)).reshape(-1)[:start + count]
    keys = k.reshape(-1, kv_heads, DIM)[slots].float().transpose(0, 1)
    values = v.reshape(-1, kv_heads, DIM)[slots].float().transpose(0, 1)
    visible = torch.arange(start + count)[None, :] <= torch.arange(start, start + count)[:, None]
    out = F.scaled_dot_product_attention(query.float().transpose(0, 1), keys, values,
                                         attn_mask=visible, scale=SCALE, enable_gqa=True)
    return out.transpose(0, 1)


@pytest.mark.parametrize("page,kv_heads,n_rep,start,count", [
    (1, 2, 4, 0, 70),              # a page per key: one table lookup per key
    (16, 2, 4, CHUNK - 20, 45),    # a chunk after a past, across a chunk boundary
    (64, 1, 8, 0, 2 * BLOCK + 5),  # pages of whole blocks: one lookup per block
    (64, 3, 3, 2 * CHUNK + 7, 19), # a group of 3 (42 tokens a tile), past 2 chunks
    (256, 2, 4, CHUNK + 10, 300),  # pages of two chunks: a chunk's blocks share a page
    (16, 4, 1, 5, 40),             # no grouping
])
def test_the_flash_kernel_equals_plain_attention(page, kv_heads, n_rep, start, count):
    k, v, table = _pool(start + count, page, kv_heads)
    query = _query(count, kv_heads * n_rep)
    got = _flash(query, k, v, table, start)
    torch.testing.assert_close(got, _reference(query, k, v, table, start), rtol=1e-5,
                               atol=1e-5)


def test_positions_past_the_end_of_the_last_page_never_reach_the_result():
    """The last page's positions past the sequence hold another request's bytes (NaN here):
    the masked block reads them as zeros, through pointers or tensor descriptors alike (pages
    of whole blocks take descriptors where ``use_tma`` says so, the interpreter included)."""
    count, page = 2 * BLOCK + 5, 64
    k, v, table = _pool(count, page, 2)
    last = int(table[0, (count - 1) // page])
    k[last, count % page:] = float("nan")
    v[last, count % page:] = float("nan")
    query = _query(count, 8)
    got = _flash(query, k, v, table, 0)
    assert not got.isnan().any()
    torch.testing.assert_close(got, _reference(query, k, v, table, 0), rtol=1e-5, atol=1e-5)


def test_a_triton_that_cannot_build_descriptor_loads_falls_back_to_pointers(monkeypatch):
    """The descriptor loads failing to build (an older or broken Triton) cost nothing but the
    speed: the step is computed through pointers, and later ones go there at once."""
    real = paged_triton.flash_prefill_kernel
    built: list[bool] = []

    class Refusing:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                built.append(kw["TMA"])
                if kw["TMA"]:
                    raise RuntimeError("PassManager::run failed")
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(paged_triton, "flash_prefill_kernel", Refusing())
    monkeypatch.setattr(paged_triton, "_DESCRIPTORS_FAILED", None)
    count, page = 2 * BLOCK + 5, 64
    k, v, table = _pool(count, page, 2)
    query = _query(count, 8)
    for _ in range(2):
        got = _flash(query, k, v, table, 0)
        torch.testing.assert_close(got, _reference(query, k, v, table, 0), rtol=1e-5, atol=1e-5)
    assert built == [True, False, False]
    assert "PassManager" in paged_triton._DESCRIPTORS_FAILED


def test_the_16_bit_path_equals_plain_attention():
    """fp16 stands in for bf16 on the CPU (the interpreter's bf16 dot is wrong): 16-bit loads
    and products, fp32 softmax."""
    start, count = 100, 40
    k, v, table = _pool(start + count, 64, 2, torch.float16)
    query = _query(count, 8, torch.float16)
    torch.testing.assert_close(_flash(query, k, v, table, start).float(),
                               _reference(query, k, v, table, start), rtol=5e-3, atol=5e-3)


# fp32 (IEEE dots) at page sizes under the key block, the 16-bit path at the one-lookup-per-block
# page size: each kernel path once (the interpreter takes ~20 s a case).
@pytest.mark.parametrize("page,dtype", [(1, torch.float32), (16, torch.float32),
                                        (64, torch.float16)])
def test_whole_chunked_and_suffix_give_the_same_bits(page, dtype):
    """A 600-token prompt (four chunk boundaries, steps starting mid-block and mid-chunk)
    whole, in the step sizes a scheduler may pick, and its last tokens as a hit's suffix
    through the flash kernel and through the split launch: all bit-identical."""
    total, kv_heads, n_rep = 600, 2, 4
    k, v, table = _pool(total, page, kv_heads, dtype, seed=page)
    query = _query(total, kv_heads * n_rep, dtype, seed=page + 1)
    whole = _flash(query, k, v, table, 0)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(whole.float(), _reference(query, k, v, table, 0), rtol=tol,
                               atol=tol)
    for sizes in ([256], [100, 37], [33, 64, 1, 200]):
        assert torch.equal(_steps(query, k, v, table, sizes), whole), sizes
    for past in (CHUNK * 4, 513, 577):    # a hit's suffix after a past on and off the chunks
        assert torch.equal(_flash(query[past:], k, v, table, past), whole[past:]), past
        assert torch.equal(_split(query[past:], k, v, table, past), whole[past:]), past


def test_the_engines_chunk_size():
    """The same with the engine's own ``CHUNK_TOKENS`` across one boundary."""
    chunk = paged_tiles.CHUNK_TOKENS
    total = chunk + 60
    k, v, table = _pool(total, 64, 1, seed=9)
    query = _query(total, 4, seed=10)
    whole = _flash(query, k, v, table, 0, chunk)
    torch.testing.assert_close(whole, _reference(query, k, v, table, 0), rtol=1e-5, atol=1e-5)
    assert torch.equal(_steps(query, k, v, table, [700, 90], chunk), whole)
    past = total - 20
    assert torch.equal(_split(query[past:], k, v, table, past, chunk), whole[past:])


def test_a_ragged_step_of_prompts_chunks_and_decodes():
    """One step: a whole prompt, a chunk after a past, two decodes and a long chunk, rows in
    scattered pages of one pool. Each prompt row gets the bits it gets alone; decodes (the
    split-KV kernel) and every row match plain attention."""
    page, kv_heads, n_rep = 16, 2, 4
    spans = [(0, 50), (130, 1), (200, 70), (40, 1), (257, 33)]    # (past, new)
    gen = torch.Generator().manual_seed(7)
    pages = sum(-(-(s + n) // page) for s, n in spans) + 4
    k = torch.randn(pages, page, kv_heads, DIM, generator=gen)
    v = torch.randn(pages, page, kv_heads, DIM, generator=gen)
    order = torch.randperm(pages, generator=gen).tolist()
    rows, used = [], 0
    for start, new in spans:
        count = -(-(start + new) // page)
        rows.append(paged.BatchRow(order[used:used + count], start, list(range(new))))
        used += count
    q_starts = [sum(n for _, n in spans[:i]) for i in range(len(spans))]
    query = _query(sum(n for _, n in spans), kv_heads * n_rep, seed=8)
    batch = paged_triton.TritonBatch(rows, q_starts, page, torch.device("cpu"))
    out = batch.attend(query, k, v, SCALE)
    for row, first in zip(rows, q_starts, strict=True):
        q = query[first:first + len(row.tokens)]
        table = torch.as_tensor([row.pages], dtype=torch.int32)
        got = out[first:first + len(row.tokens)]
        torch.testing.assert_close(got, _reference(q, k, v, table, row.start), rtol=1e-5,
                                   atol=1e-5)
        if len(row.tokens) > 1:
            assert torch.equal(got, _flash(q, k, v, table, row.start, paged_tiles.CHUNK_TOKENS))


def test_fp32_dots_run_in_ieee_precision_and_pages_of_whole_blocks_take_one_lookup():
    assert paged_tiles.precision_for(torch.float32) == "ieee"        # no TF32
    assert paged_tiles.precision_for(torch.bfloat16) != "ieee"
    assert [paged_tiles.page_run(p) for p in (1, 16, 64, 128, 96)] == [False, False, True,
                                                                        True, False]


def test_tiles_and_chunks_that_do_not_fit_are_refused():
    k, v, table = _pool(40, 16, 2)
    query = _query(40, 8)
    tiles = torch.as_tensor([(0, 0, 40, 0)], dtype=torch.int32)
    with pytest.raises(ValueError, match="at most"):
        paged_triton.paged_attention(query, k, v, table, tiles, SCALE, 40)
    with pytest.raises(ValueError, match="multiple"):
        paged_triton.paged_attention(query, k, v, table, tiles[:, :], SCALE, 32, chunk=100)
    with pytest.raises(ValueError, match="power-of-two multiple"):   # a chunk's pages: one arange
        paged_triton.paged_attention(query, k, v, table, tiles[:, :], SCALE, 32, chunk=192)
    with pytest.raises(ValueError, match="multiple of 128"):
        paged_triton.paged_attention(query, k, v, table, tiles[:, :], SCALE, 32, chunk=192,
                                     block_n=128)


@pytest.mark.parametrize("block_n,page", [(32, 64), (128, 64)])
def test_other_key_blocks_still_compute_attention(block_n, page):
    """The benchmark's launch choices (``attention_sweep.py``): other key blocks, with pages
    holding whole blocks (one lookup each) or blocks spanning pages (one lookup per key)."""
    start, count = 150, 90
    k, v, table = _pool(start + count, page, 2)
    query = _query(count, 4)
    tiles = _tiles(start, count, 2)
    got = paged_triton.paged_attention(query, k, v, table, tiles, SCALE, int(tiles[:, 2].max()),
                                       chunk=2 * block_n, block_n=block_n)
    torch.testing.assert_close(got, _reference(query, k, v, table, start), rtol=1e-5, atol=1e-5)
