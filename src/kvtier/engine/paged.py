"""One forward for many sequences, with attention read straight from the device pool's pages.

Owns ``BatchRow`` (one sequence's share of a step: its page table, where its new tokens start,
the tokens), ``PagedBatch`` (the step's metadata as tensors: where each new token's KV goes in
the pool, which pool slots each sequence's past sits in) and ``forward_batch``, which runs
transformers' model over every row's new tokens packed into one sequence of length T.

How the model is driven: ``install`` registers an attention function with transformers. Inside
``forward_batch`` (a ``PagedBatch`` set in a context variable) it writes each layer's new keys
and values into the pool at their slots (``index_copy_``), then attends each row's queries over
that row's pages: a plain PyTorch path (slots gathered per layer into a transient tensor, then
``scaled_dot_product_attention``) on the CPU, a Triton kernel that reads the pages in place on
CUDA (``kvtier.engine.paged_triton``; the prompt rows through FlashAttention 3 where
``backend_of`` picks it, ``kvtier.engine.paged_fa3``). The model itself sees no cache
(``use_cache=False``): position ids carry each token's position, and a 4-D placeholder mask
makes transformers skip building a mask over the packed tokens. Outside ``forward_batch`` the
previous attention (transformers' sdpa, or kvtier's split-KV kernels on CUDA) runs unchanged,
so the per-sequence paths (``PrefixCache.prefill``, the captured suffix forwards) keep working.

A row whose pages are still arriving from the host tier carries the copy's ticket: before a
layer is read, the current stream waits on the device for that layer's copy only, so loading a
hit overlaps the forward of every sequence in the step. Engine thread only.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

NAME = "kvtier_paged"
#: Backends whose kernels read the pool's pages in place on CUDA (``backend_of``).
KERNEL_BACKENDS = ("triton", "fa3")

_BATCH: contextvars.ContextVar[PagedBatch | None] = contextvars.ContextVar(
    "kvtier_paged_batch", default=None)


@dataclass
class BatchRow:
    """One sequence in a step: its KV lives in ``pages`` (prefix order, one per ``page_size``
    tokens); ``start`` tokens of it are already there, ``tokens`` are new (positions
    ``start ..``) and their KV is written into the same pages, which must cover them."""

    pages: Sequence[int]
    start: int
    tokens: Sequence[int]
    ticket: Any = None   # a per-layer host -> device copy still in flight into ``pages``
    #: The tokens are the prompt's own: one alone (a prompt's last token after a hit or a
    #: chunk) still attends as a prompt row, with the kernels that compute it in a whole
    #: prompt, not as a decode.
    prompt: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def decode(self) -> bool:
        """One generated token: the split-KV decode kernels serve it."""
        return len(self.tokens) == 1 and not self.prompt


class PagedBatch:
    """The tensors one step needs, built once and shared by every layer."""

    def __init__(self, rows: Sequence[BatchRow], pool: torch.Tensor, backend: str) -> None:
        page_size, device = pool.shape[3], pool.device
        self.pool, self.rows, self.backend = pool, list(rows), backend
        self.q_starts: list[int] = []
        slots, context = [], []
        first = 0
        for row in self.rows:
            if len(row.pages) * page_size < row.end:
                raise ValueError(f"{len(row.pages)} pages of {page_size} tokens cannot hold "
                                 f"{row.end} tokens")
            table = torch.as_tensor(list(row.pages), dtype=torch.long)
            every = (table[:, None] * page_size + torch.arange(page_size)).reshape(-1)
            if backend == "torch":   # the Triton kernel reads the page tables instead
                context.append(every[:row.end].to(device))
            slots.append(every[row.start:row.end])
            self.q_starts.append(first)
            first += len(row.tokens)
        self.total = first
        self.slots = torch.cat(slots).to(device)        # where each new token's KV goes
        self.context_slots = context                     # each row's past + new, in order
        self.tickets = [row.ticket for row in self.rows if row.ticket is not None]
        self.triton = None
        if backend == "torch":
            self._decodes_as_one(device)
        if backend in KERNEL_BACKENDS:
            from kvtier.engine import paged_triton

            self.triton = paged_triton.TritonBatch.build(self.rows, self.q_starts, page_size,
                                                         device, fa3=backend == "fa3")

    def _decodes_as_one(self, device: torch.device) -> None:
        """Rows of one new token attend in one call: their slots padded to the longest row,
        the padding masked out. Longer rows (prefill chunks) go one by one."""
        decodes = [i for i, row in enumerate(self.rows) if row.decode]
        self.singles = [i for i in range(len(self.rows)) if i not in set(decodes)]
        self.decode_queries = torch.as_tensor([self.q_starts[i] for i in decodes],
                                              dtype=torch.long, device=device)
        self.decode_slots = self.decode_mask = None
        if decodes:
            longest = max(self.rows[i].end for i in decodes)
            slots = torch.empty((len(decodes), longest), dtype=torch.long, device=device)
            mask = torch.zeros((len(decodes), 1, 1, longest), dtype=torch.bool, device=device)
            for j, i in enumerate(decodes):
                own = self.context_slots[i]
                slots[j] = own[0]   # padding reads the row's own first slot (finite), masked
                slots[j, :self.rows[i].end] = own
                mask[j, ..., :self.rows[i].end] = True
            self.decode_slots, self.decode_mask = slots, mask

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the step's new ``key``/``value`` (``[1, kv_heads, T, dim]``) in their slots."""
        write_slots(self.pool, layer, self.slots, key, value)

    def wait_for_layer(self, layer: int) -> None:
        for ticket in self.tickets:
            ticket.stream_wait(layer=layer)

    def attend(self, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Every row's queries (``[1, heads, T, dim]``) over its pages: ``[1, T, heads, dim]``."""
        if self.triton is not None:
            out = self.triton.attend(query[0].transpose(0, 1), self.pool[layer, 0],
                                     self.pool[layer, 1], scaling)
            return out.unsqueeze(0)
        return self._attend_torch(layer, query, scaling)

    def _attend_torch(self, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        heads, dim = self.pool.shape[4], self.pool.shape[5]
        keys = self.pool[layer, 0].view(-1, heads, dim)
        values = self.pool[layer, 1].view(-1, heads, dim)
        out = query.new_empty((1, self.total, query.shape[1], query.shape[3]))
        if self.decode_slots is not None:
            q = query[0].index_select(1, self.decode_queries).transpose(0, 1).unsqueeze(2)
            k = keys[self.decode_slots].transpose(1, 2).to(q.dtype)
            v = values[self.decode_slots].transpose(1, 2).to(q.dtype)
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=self.decode_mask,
                                                      scale=scaling, enable_gqa=True)
            out[0, self.decode_queries] = attended[:, :, 0]
        for i in self.singles:
            row, first, slots = self.rows[i], self.q_starts[i], self.context_slots[i]
            count = len(row.tokens)
            q = query[:, :, first:first + count]
            k = keys.index_select(0, slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
            v = values.index_select(0, slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
            attended = F.scaled_dot_product_attention(
                q, k, v, attn_mask=causal_mask(count, row.end, q.device), scale=scaling,
                enable_gqa=True)
            out[0, first:first + count] = attended[0].transpose(0, 1)
        return out


def write_slots(pool: torch.Tensor, layer: int, slots: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor) -> None:
    """Write a layer's new ``key``/``value`` (``[1, kv_heads, T, dim]``) into the pool at
    ``slots`` (``[T]``: page * page_size + offset), one ``index_copy_`` per part."""
    heads, dim = pool.shape[4], pool.shape[5]
    for part, new in enumerate((key, value)):
        flat = pool[layer, part].view(-1, heads, dim)
        flat.index_copy_(0, slots, new[0].transpose(0, 1).to(flat.dtype))


def causal_mask(queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """Bottom-right causal mask: query ``i`` of ``queries`` (the last positions of ``keys``)
    sees keys ``0 .. keys - queries + i``."""
    last = torch.arange(keys - queries, keys, device=device)
    return torch.arange(keys, device=device)[None, :] <= last[:, None]


@contextlib.contextmanager
def batch_context(batch: PagedBatch) -> Iterator[None]:
    token = _BATCH.set(batch)
    try:
        yield
    finally:
        _BATCH.reset(token)


def backend_of(lm: Any, setting: str = "auto") -> str:
    """The kernels ``lm``'s paged forwards run: ``torch`` off CUDA; on CUDA ``fa3`` (prompt
    rows through FlashAttention 3, ``paged_fa3.choose``) or ``triton``. Chosen once per model
    (``hf.load_model`` from ``engine.prefill_attention``; ``auto`` for a model built
    elsewhere) and kept on it, so every path of one engine (batched steps, captured suffix
    steps) computes a prompt with the same kernels."""
    backend = getattr(lm, "paged_backend", None)
    if backend is None:
        from kvtier.engine import paged_fa3

        backend, why = paged_fa3.choose(setting, lm.device, lm.dtype, lm.head_dim,
                                        bool(getattr(lm, "deterministic", False)))
        lm.paged_backend = backend
        lm.paged_backend_why = why
    return str(backend)


@torch.inference_mode()
def forward_batch(lm: Any, rows: Sequence[BatchRow], pool: torch.Tensor,
                  backend: str | None = None) -> torch.Tensor:
    """Run every row's new tokens in one forward, writing their KV into the rows' pages.
    Returns the last new position's logits of each row, ``[rows, vocab]`` fp32."""
    if not rows or any(not row.tokens for row in rows):
        raise ValueError("every row of a batch needs at least one new token")
    ensure_installed(lm.model)
    batch = PagedBatch(rows, pool, backend or backend_of(lm))
    ids = [t for row in rows for t in row.tokens]
    positions = [p for row in rows for p in range(row.start, row.end)]
    device = lm.device
    last = torch.as_tensor([first + len(row.tokens) - 1
                            for row, first in zip(rows, batch.q_starts, strict=True)],
                           device=device)
    with batch_context(batch):
        out = lm.model(input_ids=torch.as_tensor([ids], device=device),
                       position_ids=torch.as_tensor([positions], device=device),
                       attention_mask=_placeholder_mask(device), use_cache=False,
                       logits_to_keep=last)
    return out.logits[0].float()


_MASKS: dict[torch.device, torch.Tensor] = {}


def _placeholder_mask(device: torch.device) -> torch.Tensor:
    """A 4-D tensor transformers passes through untouched (the paged attention ignores it)."""
    mask = _MASKS.get(device)
    if mask is None:
        mask = _MASKS[device] = torch.zeros((1, 1, 1, 1), dtype=torch.bool, device=device)
    return mask


def ensure_installed(model: Any) -> None:
    """Install the paged attention again if something set another since (the suffix graphs)."""
    if model.config._attn_implementation not in _registered():
        install(model)


def _registered() -> set[str]:
    from transformers import AttentionInterface

    return {name for name in AttentionInterface._global_mapping if name.startswith(NAME)}


def _paged_attention(fallback: Any) -> Any:
    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
        batch = _BATCH.get()
        if batch is None:
            return fallback(module, query, key, value, attention_mask, dropout=dropout,
                            scaling=scaling, **kwargs)
        layer = module.layer_idx
        batch.wait_for_layer(layer)
        batch.write(layer, key, value)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return batch.attend(layer, query, scale), None
    return attention


def install(model: Any) -> str:
    """Make ``model`` run the paged attention inside ``forward_batch`` and its current attention
    (sdpa or kvtier's) everywhere else; returns the implementation name it set."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    previous = model.config._attn_implementation
    if previous.startswith(NAME):
        return previous
    name = f"{NAME}_{previous}"
    AttentionInterface.register(name, _paged_attention(ALL_ATTENTION_FUNCTIONS[previous]))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[previous])
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(name)
    else:
        model.config._attn_implementation = name
    return name
