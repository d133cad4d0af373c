"""Captured suffix forwards: after a cache hit, the few new tokens run as CUDA graphs.

Owns ``SuffixGraphs``. After a hit the model runs tens of new tokens over thousands of past
ones. The GPU needs a few milliseconds for that (one pass over the weights); transformers'
eager forward needs the engine thread for tens of milliseconds of kernel launches first, and
that, not the bus, was most of a short hit's TTFT. Here the forward of up to
``MAX_QUERY_TOKENS`` new tokens is captured once per bucket of new tokens (padded up to a power
of two) as one graph for the embedding, one per decoder layer and one for the last position's
logits, and replayed:

- Static buffers: the new tokens' ids and positions and the past's length (``_meta``, one
  host-to-device copy per request), the hidden state, rotary cos/sin, and every layer's KV for
  up to ``capacity`` tokens (``_kv``: ``[layers, 2, capacity, kv_heads, head_dim]``,
  token-major like the device pool's pages).
- Per request, layer by layer: wait on the device for the layer's own copy of the hit
  (``ticket.stream_wait``: host hits still cross the bus while earlier layers compute), gather
  the layer's pages from the device pool into the static KV, replay the layer's graph. The
  past's length is read on the device (``attention.device_past``), so one graph serves every
  length up to ``capacity``.
- Afterwards the static KV is copied into the sequence's own cache (``RoomyLayer.take_static``)
  on a side stream, so the first token does not wait for it; decode and commit then see an
  ordinary cache (waiting for the copy on the device) and the static buffers serve the next
  request.

Captures run transformers' modules with kvtier's fused RMSNorm and rotary kernels in place of
their element-wise chains (``fused.fused_modules``): a few-token forward is bound by its kernels.

Padding tokens (bucket minus real) compute values at positions after the real tokens; causal
attention keeps the real tokens from seeing them and their KV is never copied out.

Without CUDA (tests) the same steps run eagerly (``capture=False``), which checks the static
path against transformers' forward on the CPU. Llama, Qwen2 and Mistral-style models
(``embed_tokens``, ``rotary_emb``, ``layers``, ``norm``, ``lm_head``). Engine thread only.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from kvtier.engine import attention, invariant
from kvtier.engine.fused import fused_modules
from kvtier.engine.kv_pages import pending_hit

#: Model types whose forward is the embedding, rotary, decoder layers, norm and head in order.
SUPPORTED_MODELS = ("llama", "qwen2", "mistral")
MAX_QUERY_TOKENS = attention.MAX_QUERY_TOKENS
BUCKETS = (8, 16, 32, 64, 128)


def bucket_for(tokens: int) -> int:
    """The captured size that serves ``tokens`` new tokens (1 <= tokens <= 128)."""
    return next(b for b in BUCKETS if b >= tokens)


def unsupported_reason(lm: Any) -> str | None:
    """Why ``lm`` cannot run captured suffix forwards (None: it can)."""
    config = lm.model.config
    if getattr(config, "model_type", None) not in SUPPORTED_MODELS:
        return f"model type {getattr(config, 'model_type', None)!r} is not one of {SUPPORTED_MODELS}"
    body = getattr(lm.model, "model", None)
    for part in ("embed_tokens", "rotary_emb", "layers", "norm"):
        if not hasattr(body, part):
            return f"the model has no {part}"
    if not hasattr(lm.model, "lm_head"):
        return "the model has no lm_head"
    if lm.head_dim < 16 or lm.head_dim & (lm.head_dim - 1):
        return f"head_dim {lm.head_dim} is not a power of two >= 16"
    return None


class _StaticKV:
    """transformers' cache interface over the static KV: ``update`` writes the new tokens' keys
    and values at ``slots`` (their positions, on the device) and returns the whole buffers."""

    def __init__(self, kv: torch.Tensor, slots: torch.Tensor) -> None:
        # [1, kv_heads, capacity, dim] views of the token-major buffers, per layer and part
        self.views = [(kv[layer, 0].transpose(0, 1).unsqueeze(0),
                       kv[layer, 1].transpose(0, 1).unsqueeze(0)) for layer in range(kv.shape[0])]
        self.slots = slots

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.views[layer_idx]
        keys.index_copy_(2, self.slots, key_states)
        values.index_copy_(2, self.slots, value_states)
        return keys, values


class SuffixGraphs:
    """Captured (or, without CUDA, eager) static forwards of a fresh hit's new tokens."""

    def __init__(self, lm: Any, capacity_tokens: int, *, capture: bool | None = None,
                 fuse: bool = True) -> None:
        reason = unsupported_reason(lm)
        if reason is not None:
            raise ValueError(f"captured suffix forwards: {reason}")
        self.lm = lm
        self.capture = lm.device.type == "cuda" if capture is None else capture
        self.capacity = max(int(capacity_tokens), MAX_QUERY_TOKENS)
        self.fuse = fuse  # run the fused RMSNorm and rotary kernels (``fused.fused_modules``)
        body = lm.model.model
        self._body, self._head = body, lm.model.lm_head
        self._layers = list(body.layers[:lm.config.num_hidden_layers])
        params = inspect.signature(self._layers[0].forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._steps: dict[int, list[Callable[[], None]]] = {}
        self._pool: Any = None
        self._kv: torch.Tensor | None = None
        self._copied: Any = None  # CUDA event: the static KV handed over (``_hand_over``)
        self._copy_stream = torch.cuda.Stream(lm.device) if self.capture else None
        self.disabled: str | None = None   # why graphs stopped (a capture failed)
        self.forwards = 0
        self.captures = 0
        self.capture_s = 0.0
        self.fallbacks: Counter[str] = Counter()
        if getattr(lm.model.config, "_attn_implementation", None) != invariant.NAME:
            attention.install(lm.model)  # the deterministic mode's attention stays

    # ---- deciding ----------------------------------------------------------------------------
    def accepts(self, cache: Any, new_tokens: int) -> bool:
        """Whether ``forward`` serves ``new_tokens`` after ``cache`` (counts why not)."""
        reason = self._refusal(cache, new_tokens)
        if reason is not None:
            self.fallbacks[reason] += 1
        return reason is None

    def _refusal(self, cache: Any, new_tokens: int) -> str | None:
        if self.disabled is not None:
            return "disabled"
        if not 1 <= new_tokens <= MAX_QUERY_TOKENS:
            return "new_tokens"
        layers = cache.layers[:len(self._layers)]
        if len(layers) != len(self._layers) or any(pending_hit(layer) is None for layer in layers):
            return "not_a_fresh_hit"
        end = cache.get_seq_length() + bucket_for(new_tokens)
        if end > self.capacity:
            return "too_long"
        if layers[0].room_tokens < end - bucket_for(new_tokens) + new_tokens:
            return "no_room"
        return None

    def warm(self) -> None:
        """Capture every bucket now, so that a server's first hits pay no capture (about a
        second per bucket on the H200 for an 8B model)."""
        with torch.inference_mode():
            if not self._ensure_buffers():
                return
            self._set_inputs([0], 0)
            for bucket in BUCKETS:
                if bucket not in self._steps and self._build(bucket) is None:
                    return

    # ---- running -----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: list[int], cache: Any) -> torch.Tensor | None:
        """The last position's logits (``[vocab]`` fp32) of ``tokens`` run after the hit that
        ``cache`` holds (adopted, not yet gathered pages); ``cache`` then holds them too.
        None if the graphs could not be captured (nothing changed: run the eager forward)."""
        past, bucket = cache.get_seq_length(), bucket_for(len(tokens))
        if not self._ensure_buffers():
            return None
        self._set_inputs(tokens, past)
        steps = self._steps.get(bucket) or self._build(bucket)
        if steps is None:
            return None
        embed, *layer_steps, head = steps
        if self._copied is not None:  # the last request's KV has left the static buffers
            torch.cuda.current_stream(self.lm.device).wait_event(self._copied)
        embed()
        for layer, step in enumerate(layer_steps):
            pending_hit(cache.layers[layer]).gather_into(self._kv[layer])
            step()
        head()
        logits = self._logits.clone()
        self._hand_over(cache, past + len(tokens))
        self.forwards += 1
        return logits

    def _hand_over(self, cache: Any, length: int) -> None:
        """Copy the static KV into the sequence's cache. On CUDA on a side stream, so the first
        token does not wait for it: the cache's next use and the next request's gathers wait
        for it on the device instead."""
        layers = cache.layers[:len(self._layers)]
        if not self.capture:
            for layer, entry in enumerate(layers):
                entry.take_static(self._kv[layer], length)
            return
        current = torch.cuda.current_stream(self.lm.device)
        self._copy_stream.wait_stream(current)
        with torch.cuda.stream(self._copy_stream):
            for layer, entry in enumerate(layers):
                entry.take_static(self._kv[layer], length)
            self._copied = torch.cuda.Event()
            self._copied.record(self._copy_stream)
        for entry in layers:
            entry.use_after(self._copied)

    def _set_inputs(self, tokens: list[int], past: int) -> None:
        count = len(tokens)
        host = torch.empty(2 * MAX_QUERY_TOKENS + 2, dtype=torch.long)
        host[:count] = torch.as_tensor(tokens, dtype=torch.long)
        host[count:MAX_QUERY_TOKENS] = 0
        host[MAX_QUERY_TOKENS:2 * MAX_QUERY_TOKENS] = torch.arange(past, past + MAX_QUERY_TOKENS)
        host[-2], host[-1] = past, count - 1
        self._meta.copy_(host, non_blocking=True)  # a few hundred bytes; no stream sync

    def _ensure_buffers(self) -> bool:
        """Allocate the static buffers once; False (graphs off, counted) if they do not fit."""
        if self._kv is not None:
            return True
        if self.disabled is not None:
            return False
        try:
            self._allocate()
        except torch.OutOfMemoryError as exc:
            self.disabled = f"static buffers: {exc}".splitlines()[0]
            self.fallbacks["no_memory"] += 1
            return False
        return True

    def _allocate(self) -> None:
        lm, device = self.lm, self.lm.device
        self._meta = torch.zeros(2 * MAX_QUERY_TOKENS + 2, dtype=torch.long, device=device)
        self._ids = self._meta[:MAX_QUERY_TOKENS].view(1, -1)
        self._positions = self._meta[MAX_QUERY_TOKENS:2 * MAX_QUERY_TOKENS].view(1, -1)
        self._past, self._last = self._meta[-2:-1], self._meta[-1:]
        hidden = lm.config.hidden_size
        self._hidden = torch.zeros(1, MAX_QUERY_TOKENS, hidden, dtype=lm.dtype, device=device)
        cos, sin = self._body.rotary_emb(self._hidden, self._positions)
        self._cos, self._sin = torch.zeros_like(cos), torch.zeros_like(sin)
        self._logits = torch.zeros(lm.config.vocab_size, dtype=torch.float32, device=device)
        self._kv = torch.zeros(len(self._layers), 2, self.capacity, lm.num_kv_heads, lm.head_dim,
                               dtype=lm.dtype, device=device)

    # ---- the steps and their capture -------------------------------------------------------
    def _make_steps(self, bucket: int) -> list[Callable[[], None]]:
        """The embedding, each layer and the head, as calls on the static buffers."""
        ids, positions = self._ids[:, :bucket], self._positions[:, :bucket]
        hidden = self._hidden[:, :bucket]
        cos, sin = self._cos[:, :bucket], self._sin[:, :bucket]
        static_kv = _StaticKV(self._kv, positions[0])

        def embed() -> None:
            hidden.copy_(self._body.embed_tokens(ids))
            new_cos, new_sin = self._body.rotary_emb(hidden, positions)
            cos.copy_(new_cos)
            sin.copy_(new_sin)

        def layer_step(layer: Any) -> Callable[[], None]:
            def step() -> None:
                out = layer(hidden, attention_mask=None, position_ids=positions,
                            use_cache=True, position_embeddings=(cos, sin),
                            **{self._cache_arg: static_kv})
                hidden.copy_(out[0] if isinstance(out, tuple) else out)
            return step

        def head() -> None:
            last = hidden.index_select(1, self._last)
            self._logits.copy_(self._head(self._body.norm(last))[0, 0].float())

        return [embed, *(layer_step(layer) for layer in self._layers), head]

    def _build(self, bucket: int) -> list[Callable[[], None]] | None:
        """The steps for ``bucket``: captured as CUDA graphs (once), or eager without CUDA."""
        steps = self._make_steps(bucket)
        if self.capture:
            started = time.perf_counter()
            try:
                steps = self._capture(steps)
            except Exception as exc:  # any capture failure: serve eagerly
                self.disabled = f"{type(exc).__name__}: {exc}"
                self.fallbacks["capture_failed"] += 1
                return None
            self.captures += 1
            self.capture_s += time.perf_counter() - started
        else:
            steps = [self._eager(step) for step in steps]
        self._steps[bucket] = steps
        return steps

    def _eager(self, step: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with attention.device_past(self._past), self._modules():
                step()
        return run

    def _modules(self) -> Any:
        return fused_modules(self.lm.model) if self.fuse else contextlib.nullcontext()

    def _capture(self, steps: list[Callable[[], None]]) -> list[Callable[[], None]]:
        """Warm the steps up on a side stream (Triton compiles, cuBLAS picks its kernels),
        then capture each into a graph; all graphs share one memory pool (they never run at
        once and keep nothing between steps outside the static buffers)."""
        current = torch.cuda.current_stream(self.lm.device)
        side = torch.cuda.Stream(self.lm.device)
        side.wait_stream(current)
        with torch.cuda.stream(side), attention.device_past(self._past), self._modules():
            for step in steps:
                step()
        current.wait_stream(side)
        graphs = []
        for step in steps:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"), \
                    attention.device_past(self._past), self._modules():
                step()
            if self._pool is None:
                self._pool = graph.pool()
            graphs.append(graph)
        return [graph.replay for graph in graphs]

    def stats(self) -> dict[str, Any]:
        kv_bytes = 0 if self._kv is None else self._kv.numel() * self._kv.element_size()
        return {"forwards": self.forwards, "captures": self.captures,
                "capture_s": round(self.capture_s, 3), "capacity_tokens": self.capacity,
                "static_kv_bytes": kv_bytes,
                "fallbacks": dict(self.fallbacks), "disabled": self.disabled}
