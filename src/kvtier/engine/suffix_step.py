"""A step that is one fresh hit's suffix alone runs as captured paged forwards.

Owns ``SuffixStep`` and ``StaticSuffix``. On an otherwise idle engine, the step after a cache
hit is a few new tokens over a long past: the GPU needs a few milliseconds for it, an eager
forward of an 8B model tens of milliseconds of kernel launches first. So when a step has
exactly one row, that row finishes its prompt and its new tokens fit a bucket (8 .. 128,
powers of two), the step replays graphs captured once per bucket: one for the embedding and
rotary, one per decoder layer, one for the last position's logits.

The graphs compute exactly what the batched step computes: each layer writes the new tokens' KV
into the row's own pages and attends them with the same paged kernels over the device pool
(``paged_triton``, or its split launch: the same bits; FA3 where the engine's prompts run
through it, ``paged_fa3``), so a hit's first token does not depend
on whether its step was captured (parity with a no-cache run, measured in
``benchmarks/serve/serve_parity.py``). Between layer replays the current stream waits on the device
for that layer's host copy only (a host hit still crossing the bus), so loading keeps
overlapping the forward.

Static buffers (``StaticSuffix``): token ids, positions, KV slots, a page table of
``capacity_tokens`` / page size pages, the kernel's query blocks, hidden state, rotary cos/sin
and the logits; ``fill`` writes one row into them (one host-to-device copy each). Padding
tokens (bucket minus real) compute at positions after the real ones and write their KV to a
scratch page (never a real one); the query blocks stop at the real tokens, so no real token
sees them. Without CUDA (tests) the same static steps run eagerly over a PyTorch attention.
A capture failure or a lack of memory turns the graphs off (counted in ``stats``) and the
step runs eagerly; nothing fails a request. Engine thread only.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kvtier.engine import paged

BUCKETS = (8, 16, 32, 64, 128)
MAX_TOKENS = BUCKETS[-1]
#: Buckets up to this many new tokens attend with the split launch (``paged_prefill_split``):
#: a few tokens give the flash kernel a handful of programs over the whole past. Larger
#: buckets have query blocks enough, and their partials would cost 2-4x the memory.
SPLIT_BUCKET = 32
#: Longest past + new tokens the captured steps serve (on CUDA): the split partials are sized
#: for it (``SPLIT_BUCKET`` tokens x query heads x 64 chunks of 1024 keys x head_dim in fp32:
#: 34 MB for an 8B model's 32 x 128). A longer hit steps eagerly; its load (hundreds of milliseconds)
#: dwarfs the eager forward's launches.
MAX_PAST_TOKENS = 65536
#: Query rows one tile of the paged kernels holds, as ``paged_tiles.MAX_ROWS`` (kept here
#: so that this module imports without Triton; a test checks they agree).
MAX_ROWS = 128


def bucket_for(tokens: int) -> int:
    """The captured size that serves ``tokens`` new tokens (1 <= tokens <= 128)."""
    return next(b for b in BUCKETS if b >= tokens)


class StaticSuffix:
    """One bucket's static inputs and outputs, and the attention's batch inside its graphs."""

    def __init__(self, lm: Any, pool: torch.Tensor, bucket: int, width: int, scratch_page: int,
                 backend: str, parts: Any = None) -> None:
        device, config = pool.device, lm.config
        self.pool, self.bucket, self.width, self.backend = pool, bucket, width, backend
        self.parts = parts   # split-launch partials (``paged_prefill_split``), or None: the flash kernel
        self.page_size, self.scratch_page = int(pool.shape[3]), scratch_page
        n_rep = config.num_attention_heads // int(pool.shape[4])
        self.per_block = max(1, MAX_ROWS // n_rep)
        self.longest = min(self.per_block, bucket)
        self.ids = torch.zeros((1, bucket), dtype=torch.long, device=device)
        self.positions = torch.zeros((1, bucket), dtype=torch.long, device=device)
        self.slots = torch.zeros(bucket, dtype=torch.long, device=device)
        self.table = torch.zeros((1, width), dtype=torch.int32, device=device)
        self.blocks = torch.zeros((-(-bucket // self.per_block), 4), dtype=torch.int32,
                                  device=device)
        self.last = torch.zeros(1, dtype=torch.long, device=device)
        self.fa3 = None   # FA3's static plan (``paged_fa3_plan``), filled per replay
        if backend == "fa3":
            from kvtier.engine import paged_fa3_plan

            self.fa3 = paged_fa3_plan.StaticPlan(bucket, width * self.page_size, self.page_size,
                                                 device)
        self.hidden = torch.zeros((1, bucket, config.hidden_size), dtype=lm.dtype, device=device)
        self.out = torch.zeros((bucket, config.num_attention_heads, int(pool.shape[5])),
                               dtype=lm.dtype, device=device)
        self.logits = torch.zeros(config.vocab_size, dtype=torch.float32, device=device)
        self.embeddings: tuple[torch.Tensor, torch.Tensor] | None = None
        self.fill(None)   # padding everywhere: what warm-up and capture run on

    def fill(self, row: paged.BatchRow | None) -> None:
        """Write ``row`` (its past within the table's width) and padding after its tokens."""
        page, bucket = self.page_size, self.bucket
        count = len(row.tokens) if row is not None else 0
        start = row.start if row is not None else 0
        ids = torch.zeros(bucket, dtype=torch.long)
        slots = self.scratch_page * page + torch.arange(bucket, dtype=torch.long) % page
        table = torch.full((1, self.width), self.scratch_page, dtype=torch.int32)
        if row is not None:
            ids[:count] = torch.as_tensor(list(row.tokens), dtype=torch.long)
            used = -(-row.end // page)
            pages = torch.as_tensor(list(row.pages[:used]), dtype=torch.long)
            table[0, :used] = pages.to(torch.int32)
            every = (pages[:, None] * page + torch.arange(page)).reshape(-1)
            slots[:count] = every[start:row.end]
        offsets = torch.arange(self.blocks.shape[0], dtype=torch.int32) * self.per_block
        blocks = torch.stack([torch.zeros_like(offsets), offsets,
                              (count - offsets).clamp(0, self.per_block), start + offsets], 1)
        positions = torch.arange(start, start + bucket, dtype=torch.long)
        last = torch.tensor([max(count - 1, 0)], dtype=torch.long)
        for static, host in ((self.ids[0], ids), (self.positions[0], positions),
                             (self.slots, slots), (self.table, table), (self.blocks, blocks),
                             (self.last, last)):
            static.copy_(host)
        if self.fa3 is not None:
            self.fa3.fill(row)

    # ---- what the paged attention calls (as on a ``PagedBatch``) ---------------------------
    def wait_for_layer(self, layer: int) -> None:
        """Nothing to do inside a graph: ``SuffixStep`` waits between layer replays."""

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        paged.write_slots(self.pool, layer, self.slots, key, value)

    def attend(self, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """``query`` ``[1, heads, bucket, dim]`` over the row's pages: ``[1, bucket, heads, dim]``."""
        q = query[0].transpose(0, 1)
        if self.fa3 is not None:   # the real tokens' rows; padding rows keep what they held
            from kvtier.engine import paged_fa3

            paged_fa3.attend(q, self.pool[layer, 0], self.pool[layer, 1], self.fa3.plan,
                             scaling, self.out)
            return self.out.unsqueeze(0)
        if self.backend == "triton":
            from kvtier.engine import paged_prefill_split, paged_triton

            if self.parts is not None:
                paged_prefill_split.split_prefill(q, self.pool[layer, 0], self.pool[layer, 1],
                                                  self.table, self.blocks, scaling, self.out,
                                                  self.parts)
            else:
                paged_triton.paged_attention(q, self.pool[layer, 0], self.pool[layer, 1],
                                             self.table, self.blocks, scaling, self.longest,
                                             self.out)
            return self.out.unsqueeze(0)
        return self._attend_torch(layer, q, scaling).unsqueeze(0)

    def _attend_torch(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """Every query over the whole padded table, keys after its own position masked out."""
        page, heads, dim = self.page_size, self.pool.shape[4], self.pool.shape[5]
        slots = (self.table.long()[0, :, None] * page + torch.arange(page, device=q.device))
        slots = slots.reshape(-1)
        keys = self.pool[layer, 0].view(-1, heads, dim)[slots].transpose(0, 1).to(q.dtype)
        values = self.pool[layer, 1].view(-1, heads, dim)[slots].transpose(0, 1).to(q.dtype)
        visible = torch.arange(slots.shape[0], device=q.device)[None, :] <= self.positions[0, :, None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0),
                                             values.unsqueeze(0), attn_mask=visible[None, None],
                                             scale=scaling, enable_gqa=True)
        return out[0].transpose(0, 1)


class SuffixStep:
    """Runs a lone fresh-hit step through captured paged graphs; see the module docstring.
    ``scratch_page`` is called once for a page of the pool no sequence uses."""

    def __init__(self, lm: Any, capacity_tokens: int, scratch_page: Callable[[], int], *,
                 capture: bool | None = None, backend: str | None = None) -> None:
        if capacity_tokens < MAX_TOKENS:
            raise ValueError(f"captured suffix steps need a capacity of at least {MAX_TOKENS} "
                             f"tokens, got {capacity_tokens}")
        self.lm, self.capacity, self._scratch_source = lm, capacity_tokens, scratch_page
        self.capture = lm.device.type == "cuda" if capture is None else capture
        self.backend = backend or paged.backend_of(lm)
        self._entries: dict[int, tuple[StaticSuffix, list[Callable[[], None]]]] = {}
        self._scratch: int | None = None
        self._parts: Any = None         # split partials shared by the split buckets
        self._pool: Any = None          # the graphs' shared memory pool
        self._kv: torch.Tensor | None = None
        self.disabled: str | None = None
        self.served = self.captures = 0
        self.capture_s = 0.0
        self.fallbacks: Counter[str] = Counter()

    def eligible(self, row: paged.BatchRow, prompt_tokens: int, fresh: bool,
                 page_size: int) -> bool:
        """A fresh hit's whole suffix (new tokens within a bucket), its past whole pages or
        the whole prompt but its last token (a prompt cached whole: that token runs alone)."""
        return (fresh and row.start > 0 and 1 <= len(row.tokens) <= MAX_TOKENS
                and row.end == prompt_tokens
                and (row.start % page_size == 0 or len(row.tokens) == 1))

    @torch.inference_mode()
    def run(self, row: paged.BatchRow, pool: torch.Tensor) -> torch.Tensor | None:
        """``[1, vocab]`` logits of the row's last token, its KV written into its pages; None
        where the step runs eagerly instead (nothing written)."""
        if self.disabled is not None:
            return None
        page_size = int(pool.shape[3])
        if -(-row.end // page_size) > self.width(page_size):
            self.fallbacks["too_long"] += 1
            return None
        self._bind(pool)
        bucket = bucket_for(len(row.tokens))
        entry = self._entries.get(bucket) or self._build(bucket, pool)
        if entry is None:
            return None
        static, (embed, *layers, head) = entry
        try:
            static.fill(row)
            embed()
            for layer, step in enumerate(layers):
                if row.ticket is not None:
                    row.ticket.stream_wait(layer=layer)
                step()
            head()
        except Exception as exc:  # the step reruns eagerly over the same slots
            self._disable("replay_failed", exc)
            return None
        self.served += 1
        return static.logits.unsqueeze(0).clone()

    def width(self, page_size: int) -> int:
        """Pages in a captured table: the capacity, rounded up to whole pages."""
        return -(-self.capacity // page_size)

    @torch.inference_mode()
    def warm(self, pool: torch.Tensor) -> int:
        """Capture every bucket now (not on a request's clock); returns the buckets held."""
        self._bind(pool)
        for bucket in BUCKETS:
            if self.disabled is None and bucket not in self._entries:
                self._build(bucket, pool)
        return len(self._entries)

    def _bind(self, pool: torch.Tensor) -> None:
        if self._kv is not pool:   # another pool: graphs bound to the old one are void
            self._entries.clear()
            self._kv, self._scratch, self._parts = pool, None, None

    def _build(self, bucket: int, pool: torch.Tensor
               ) -> tuple[StaticSuffix, list[Callable[[], None]]] | None:
        try:
            if self._scratch is None:
                self._scratch = int(self._scratch_source())
            static = StaticSuffix(self.lm, pool, bucket, self.width(int(pool.shape[3])),
                                  self._scratch, self.backend, self._split_parts(pool, bucket))
        except Exception as exc:  # no page or no memory for the buffers
            self._disable("no_memory", exc)
            return None
        steps = self._steps(static)
        if self.capture:
            started = time.perf_counter()
            try:
                steps = self._capture(steps)
            except Exception as exc:  # any capture failure: serve eagerly
                self._disable("capture_failed", exc)
                return None
            self.captures += 1
            self.capture_s += time.perf_counter() - started
        self._entries[bucket] = static, steps
        return static, steps

    def _split_parts(self, pool: torch.Tensor, bucket: int) -> Any:
        """The split partials (allocated once, for ``SPLIT_BUCKET``) for a split bucket on
        CUDA; None where the flash kernel runs."""
        if self.backend != "triton" or bucket > SPLIT_BUCKET:
            return None
        if self._parts is None:
            from kvtier.engine import paged_prefill_split, paged_triton

            n_rep = self.lm.config.num_attention_heads // int(pool.shape[4])
            blocks = -(-SPLIT_BUCKET // max(1, MAX_ROWS // n_rep))
            chunks = -(-self.width(int(pool.shape[3])) * int(pool.shape[3])
                       // paged_triton.CHUNK_TOKENS)
            self._parts = paged_prefill_split.partials(blocks, int(pool.shape[4]), chunks,
                                                       int(pool.shape[5]), pool.device)
        return self._parts

    def _disable(self, reason: str, exc: Exception) -> None:
        self.fallbacks[reason] += 1
        self.disabled = f"{reason}: {type(exc).__name__}: {exc}".splitlines()[0]
        self._entries.clear()

    def _steps(self, static: StaticSuffix) -> list[Callable[[], None]]:
        """The embedding and rotary, each decoder layer, the head: calls on ``static``."""
        model, body = self.lm.model, self.lm.model.model
        mask = paged._placeholder_mask(static.ids.device)
        layers = body.layers[:model.config.num_hidden_layers]

        def embed() -> None:
            paged.ensure_installed(model)
            static.hidden.copy_(body.embed_tokens(static.ids))
            cos, sin = body.rotary_emb(static.hidden, static.positions)
            if static.embeddings is None:
                static.embeddings = (torch.empty_like(cos), torch.empty_like(sin))
            static.embeddings[0].copy_(cos)
            static.embeddings[1].copy_(sin)

        def layer_step(layer: Any) -> Callable[[], None]:
            def step() -> None:
                with paged.batch_context(static):
                    out = layer(static.hidden, attention_mask=mask,
                                position_ids=static.positions, use_cache=False,
                                position_embeddings=static.embeddings)
                static.hidden.copy_(out[0] if isinstance(out, tuple) else out)
            return step

        def head() -> None:
            last = static.hidden.index_select(1, static.last)
            static.logits.copy_(model.lm_head(body.norm(last))[0, 0].float())

        return [embed, *(layer_step(layer) for layer in layers), head]

    def _capture(self, steps: list[Callable[[], None]]) -> list[Callable[[], None]]:
        """Warm up on a side stream (Triton compiles, cuBLAS picks kernels) over the padding,
        then capture each step; every graph shares one memory pool (they never run at once
        and keep nothing between steps outside the static buffers)."""
        device = self.lm.device
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for step in steps:
                step()
        current.wait_stream(side)
        graphs = []
        for step in steps:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                step()
            if self._pool is None:
                self._pool = graph.pool()
            graphs.append(graph)
        return [graph.replay for graph in graphs]

    def stats(self) -> dict[str, Any]:
        return {"served": self.served, "captures": self.captures,
                "capture_s": round(self.capture_s, 3), "buckets": sorted(self._entries),
                "capacity_tokens": self.capacity, "fallbacks": dict(self.fallbacks),
                "disabled": self.disabled}
