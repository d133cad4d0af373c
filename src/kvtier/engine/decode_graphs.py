"""Captured batched decode: a step whose rows are all single tokens replays a CUDA graph.

Owns ``DecodeGraphs`` and ``StaticDecode``. An eager forward of an 8B model costs the engine
thread ~20 ms of Python and kernel launches, several times the GPU's own time for a decode step.
So a step of decode rows only (one new token each, no host copy in flight) runs as a graph
captured once per key (batch bucket, table width):

- Batch buckets are powers of two up to ``max_batch`` (``engine.decode_graph_batch``); rows
  past the real ones are padding: token 0 at position 0, its KV written to a scratch slot (a
  page the engine holds for this and never shares) and read back from there, never a real page.
- The table width is the past padded to a power of two of at least ``CHUNK_TOKENS`` keys (in
  pages), so one graph serves every length up to it and the split-KV grid stays small.
- Static buffers (``StaticDecode``): token ids, positions, KV slots, page tables, the decode rows
  (row, query, keys), the logits. ``fill`` writes one step's rows into them (host tensors, one
  copy each, from pinned memory on CUDA); replay runs the embedding, every decoder layer (the
  paged attention reading the static batch in place of ``PagedBatch``: new KV to its slots,
  split-KV over its pages) and the head. ``run`` returns a copy of the logits; ``launch`` only
  queues the step (its token ids may come from the device: ``ahead`` queues a step before the
  one in flight has handed its tokens to the host).

Any capture failure or a lack of memory turns the graphs off (counted in ``stats``) and the
step runs eagerly; nothing fails a request. Without CUDA (tests) the same static steps run
eagerly each time (``capture=False``), so the bookkeeping (buckets, padding, filling) is the
code the CPU tests run; only ``_capture`` is CUDA-only. Engine thread only.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kvtier.engine import paged

#: Keys per split-KV chunk, as ``kvtier.engine.paged_split.CHUNK_TOKENS`` (kept here so this
#: module imports without Triton; a test checks they agree).
CHUNK_TOKENS = 256


def bucket_for(rows: int, max_batch: int) -> int | None:
    """The smallest power of two holding ``rows``, or None past ``max_batch``."""
    bucket = 1 << max(0, rows - 1).bit_length()
    return bucket if rows >= 1 and bucket <= max_batch else None


def width_for(keys: int, page_size: int) -> int:
    """Pages per table row of the graph serving pasts up to ``keys`` positions."""
    span = max(CHUNK_TOKENS, 1 << max(0, keys - 1).bit_length())
    return -(-span // page_size)


class StaticDecode:
    """One graph's static inputs and outputs, and the attention's batch inside it."""

    def __init__(self, lm: Any, pool: torch.Tensor, bucket: int, width: int,
                 scratch_page: int, backend: str) -> None:
        device = pool.device
        self.pool, self.bucket, self.width, self.backend = pool, bucket, width, backend
        self.page_size, self.scratch_page = int(pool.shape[3]), scratch_page
        self.ids = torch.zeros((1, bucket), dtype=torch.long, device=device)
        self.positions = torch.zeros((1, bucket), dtype=torch.long, device=device)
        self.slots = torch.zeros(bucket, dtype=torch.long, device=device)
        self.table = torch.zeros((bucket, width), dtype=torch.int32, device=device)
        self.decodes = torch.zeros((bucket, 3), dtype=torch.int32, device=device)
        self.logits = torch.zeros((bucket, lm.config.vocab_size), dtype=torch.float32,
                                  device=device)
        self.fill([])   # padding everywhere: what warm-up and capture run on

    def fill(self, rows: Sequence[paged.BatchRow], ids: torch.Tensor | None = None) -> None:
        """Write ``rows`` (one new token each, pasts within the width) and padding after them.

        On CUDA the host side is built in pinned memory and copied without waiting: a blocking
        copy from pageable memory would hold the engine thread until the step already queued on
        the stream is done, which a step queued ahead (``ahead``) must not. ``ids``: the
        rows' tokens as a device tensor (the step before's choice, not known on the host yet),
        in place of ``row.tokens``."""
        page, n = self.page_size, len(rows)
        pin = self.ids.device.type == "cuda"
        ids_host = torch.zeros(self.bucket, dtype=torch.long, pin_memory=pin)
        positions = torch.zeros(self.bucket, dtype=torch.long, pin_memory=pin)
        slots = torch.full((self.bucket,), self.scratch_page * page, dtype=torch.long,
                           pin_memory=pin)
        table = torch.full((self.bucket, self.width), self.scratch_page, dtype=torch.int32,
                           pin_memory=pin)
        decodes = torch.ones((self.bucket, 3), dtype=torch.int32, pin_memory=pin)
        decodes[:, 0] = decodes[:, 1] = torch.arange(self.bucket, dtype=torch.int32)
        for i, row in enumerate(rows):
            used = -(-row.end // page)
            if ids is None:
                ids_host[i] = row.tokens[0]
            positions[i] = row.start
            table[i, :used] = torch.as_tensor(list(row.pages[:used]), dtype=torch.int32)
            slots[i] = row.pages[row.start // page] * page + row.start % page
            decodes[i, 2] = row.end
        for static, host in ((self.ids[0], ids_host), (self.positions[0], positions),
                             (self.slots, slots), (self.table, table), (self.decodes, decodes)):
            static.copy_(host, non_blocking=pin)
        if ids is not None:
            self.ids[0, :n].copy_(ids)
        self.rows = n

    # ---- what the paged attention calls (as on a ``PagedBatch``) ---------------------------
    def wait_for_layer(self, layer: int) -> None:
        """Nothing is in flight: rows with a host copy pending never run here."""

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        paged.write_slots(self.pool, layer, self.slots, key, value)

    def attend(self, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """``query`` ``[1, heads, bucket, dim]`` over each row's pages: ``[1, bucket, heads, dim]``."""
        q = query[0].transpose(0, 1)
        if self.backend in paged.KERNEL_BACKENDS:
            from kvtier.engine import paged_split

            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            paged_split.split_decode(q, self.pool[layer, 0], self.pool[layer, 1], self.table,
                                     self.decodes, scaling,
                                     paged_split.splits_for(self.width * self.page_size), out)
            return out.unsqueeze(0)
        return self._attend_torch(layer, q, scaling).unsqueeze(0)

    def _attend_torch(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """Every row over its whole padded table, the keys past its length masked out."""
        page, heads, dim = self.page_size, self.pool.shape[4], self.pool.shape[5]
        offsets = torch.arange(page, device=q.device)
        slots = (self.table.long()[:, :, None] * page + offsets).reshape(self.bucket, -1)
        keys = self.pool[layer, 0].view(-1, heads, dim)[slots].transpose(1, 2).to(q.dtype)
        values = self.pool[layer, 1].view(-1, heads, dim)[slots].transpose(1, 2).to(q.dtype)
        visible = torch.arange(slots.shape[1], device=q.device) < self.decodes[:, 2:3]
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values,
                                             attn_mask=visible[:, None, None, :], scale=scaling,
                                             enable_gqa=True)
        return out[:, :, 0]


class DecodeGraphs:
    """Serves all-decode steps of up to ``max_batch`` rows from captured graphs; see the module
    docstring. ``scratch_page`` is called once for a page of the pool no sequence uses."""

    def __init__(self, lm: Any, max_batch: int, scratch_page: Callable[[], int], *,
                 capture: bool | None = None, backend: str | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"decode graphs need a batch of at least 1, got {max_batch}")
        self.lm, self.max_batch, self._scratch_source = lm, max_batch, scratch_page
        self.capture = lm.device.type == "cuda" if capture is None else capture
        self.backend = backend or paged.backend_of(lm)
        self._entries: dict[tuple[int, int], tuple[StaticDecode, Callable[[], None]]] = {}
        self._scratch: int | None = None
        self._pool: Any = None          # the graphs' shared memory pool
        self._kv: torch.Tensor | None = None
        self.disabled: str | None = None
        self.served = self.captures = 0
        self.capture_s = 0.0
        self.fallbacks: Counter[str] = Counter()

    def key_for(self, rows: Sequence[paged.BatchRow], page_size: int) -> tuple[int, int] | None:
        """(bucket, width) serving ``rows``, or None (counted) if a graph cannot."""
        if any(not row.decode for row in rows):
            return None   # prefill in the step: eager, not a fallback
        if any(row.ticket is not None for row in rows):
            self.fallbacks["loading"] += 1
            return None
        bucket = bucket_for(len(rows), self.max_batch)
        if bucket is None:
            self.fallbacks["batch_too_large"] += 1
            return None
        return bucket, width_for(max(row.end for row in rows), page_size)

    @torch.inference_mode()
    def run(self, rows: Sequence[paged.BatchRow], pool: torch.Tensor) -> torch.Tensor | None:
        """``[rows, vocab]`` fp32 logits of an all-decode step (its KV written into its pages),
        or None where the step runs eagerly."""
        logits = self.launch(rows, pool)
        return None if logits is None else logits.clone()

    @torch.inference_mode()
    def launch(self, rows: Sequence[paged.BatchRow], pool: torch.Tensor,
               ids: torch.Tensor | None = None, *, build: bool = True) -> torch.Tensor | None:
        """Queue the step and return its logits in the graph's own buffer (valid until the next
        launch of that graph is queued), or None where it runs eagerly. ``ids``: the rows'
        tokens on the device (``StaticDecode.fill``); ``build=False``: only a graph already
        captured serves (a step launched while another is in flight captures nothing)."""
        if self.disabled is not None:
            return None
        key = self.key_for(rows, int(pool.shape[3]))
        if key is None:
            return None
        self._bind(pool)
        entry = self._entries.get(key)
        if entry is None and build:
            entry = self._build(key, pool)
        if entry is None:
            return None
        static, replay = entry
        try:
            static.fill(rows, ids)
            replay()
        except Exception as exc:  # the step reruns eagerly over the same slots
            self._disable("replay_failed", exc)
            return None
        self.served += 1
        return static.logits[:len(rows)]

    @torch.inference_mode()
    def warm(self, pool: torch.Tensor, keys: int) -> int:
        """Capture every bucket for pasts up to ``keys`` now (not on a step's clock); returns
        the graphs held."""
        self._bind(pool)
        width = width_for(keys, int(pool.shape[3]))
        bucket = 1
        while bucket <= self.max_batch and self.disabled is None:
            if (bucket, width) not in self._entries:
                self._build((bucket, width), pool)
            bucket *= 2
        return len(self._entries)

    def _bind(self, pool: torch.Tensor) -> None:
        if self._kv is not pool:   # another pool: graphs bound to the old one are void
            self._entries.clear()
            self._kv, self._scratch = pool, None

    def _build(self, key: tuple[int, int], pool: torch.Tensor
               ) -> tuple[StaticDecode, Callable[[], None]] | None:
        try:
            if self._scratch is None:
                self._scratch = int(self._scratch_source())
            static = StaticDecode(self.lm, pool, key[0], key[1], self._scratch, self.backend)
        except Exception as exc:  # no page or no memory for the buffers
            self._disable("no_memory", exc)
            return None
        step = self._step(static)
        started = time.perf_counter()
        if self.capture:
            try:
                step = self._capture(step)
            except Exception as exc:  # any capture failure: serve eagerly
                self._disable("capture_failed", exc)
                return None
            self.captures += 1
            self.capture_s += time.perf_counter() - started
        self._entries[key] = static, step
        return static, step

    def _disable(self, reason: str, exc: Exception) -> None:
        self.fallbacks[reason] += 1
        self.disabled = f"{reason}: {type(exc).__name__}: {exc}".splitlines()[0]
        self._entries.clear()

    def _step(self, static: StaticDecode) -> Callable[[], None]:
        """The forward over ``static``: embedding, rotary, decoder layers, norm, head."""
        model, body = self.lm.model, self.lm.model.model
        mask = paged._placeholder_mask(static.ids.device)

        def step() -> None:
            paged.ensure_installed(model)
            hidden = body.embed_tokens(static.ids)
            embeddings = body.rotary_emb(hidden, static.positions)
            with paged.batch_context(static):
                for layer in body.layers[:model.config.num_hidden_layers]:
                    out = layer(hidden, attention_mask=mask, position_ids=static.positions,
                                use_cache=False, position_embeddings=embeddings)
                    hidden = out[0] if isinstance(out, tuple) else out
            static.logits.copy_(model.lm_head(body.norm(hidden))[0].float())
        return step

    def _capture(self, step: Callable[[], None]) -> Callable[[], None]:
        """Warm up on a side stream (Triton compiles, cuBLAS picks kernels) over the padding,
        then capture; every graph shares one memory pool (they never run at once)."""
        device = self.lm.device
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            step()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            step()
        if self._pool is None:
            self._pool = graph.pool()
        return graph.replay

    def stats(self) -> dict[str, Any]:
        return {"served": self.served, "captures": self.captures,
                "capture_s": round(self.capture_s, 3),
                "graphs": sorted(self._entries), "max_batch": self.max_batch,
                "fallbacks": dict(self.fallbacks), "disabled": self.disabled}
