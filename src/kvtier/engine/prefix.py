"""Prefill through the tiered cache: match, load (or recompute) the hit, prefill the rest, commit.

Owns ``PrefixCache``, the engine's side of ``kvtier.cache.TieredCache``. For each prompt:

1. ``match`` the prompt's full pages; the hit may sit on any tier (device, host, disk, remote).
2. Split the hit (``plan_split``, the planner's cost model) when part of it comes from a store
   (disk, remote): recompute its head while the tail loads, so both finish together. The tail's
   store reads start first (``prefetch``), then the head's forward is launched (on CUDA it is
   only queued, so the GPU computes while the IO workers read; launching a long forward takes
   the engine thread a while), then ``load`` waits for the reads (on the CPU the head runs on a
   helper thread meanwhile). A hit held in RAM (device,
   host) is loaded whole: loading wins outright there. ``split="load"`` never recomputes,
   ``split="recompute"`` never loads.
3. ``load`` the tail to device pages (pinned by the returned ``Loaded``) and append their KV to
   the model's cache after the recomputed head. On CUDA a hit from the host tier is not waited
   for (``overlap``): its copy runs layer by layer on a side stream while the forward runs, each
   layer waiting on the device for its own pages only, so TTFT is about the copy time, not the
   copy plus the forward.
4. Prefill the remaining tokens (at least one: the last position's logits choose the first
   token), write every full page the device tier does not hold into fresh device pages,
   ``commit`` them all under the write policy, and release the pins.

``finish`` commits the full pages generation added. The model's cache keeps a private copy of
the KV, so pages go back to the cache as soon as they are committed. Cold prefills are timed and
reported (``observe_prefill``): the split needs the model's prefill rate. Engine thread only,
plus one helper thread that runs a CPU recompute while the engine thread waits for the load.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.config import KvtierConfig
from kvtier.engine import kv_pages
from kvtier.engine.hf import CausalLM, resolve_deterministic, resolve_device
from kvtier.engine.request import TIERS, PrefillReport
from kvtier.keys import KeyNamespace

SPLITS = ("plan", "load", "recompute")
STORE_TIERS = ("disk", "remote")
#: Shorter cold prefills are not reported to the planner: fixed per-call costs dominate them.
MIN_OBSERVED_PREFILL_TOKENS = 256
#: Room left in a hit's gathered KV for generated tokens (past the rest of the prompt).
DECODE_ROOM_TOKENS = 256


@dataclass
class PrefixState:
    """What a sequence keeps from prefill to finish: the load's pins until the prompt is
    committed (``commit_prompt``), then how many full pages it has committed."""

    salt: str | None
    loaded: Any = None
    span: tuple[int, int, list[int]] | None = None
    committed_pages: int = 0
    split: tuple[int, float, float] | None = None   # (hit tokens, predicted s, start) of a split


def split_for(config: KvtierConfig, lm: CausalLM | None = None) -> str:
    """The split policy ``engine.store_hit_split`` names: ``auto`` splits store hits only where
    the split is exact (``engine.deterministic``: batch-invariant kernels give a recomputed
    head the stored pages' bytes); elsewhere library matmuls tile by the forward's row count, so
    a head recomputed in a forward of another length rounds differently and can flip a greedy
    token, and the hit is loaded whole. ``lm``: the model as loaded (its kernels decide);
    without it, the config's setting on the config's device."""
    choice = config.engine.store_hit_split
    if choice == "auto":
        if lm is not None:
            exact = lm.deterministic
        else:
            exact = resolve_deterministic(config.engine.deterministic,
                                          resolve_device(config.engine.device))
        return "plan" if exact else "load"
    return choice


class PrefixCache:
    """Serves prefills from a ``TieredCache``; see the module docstring."""

    def __init__(self, lm: CausalLM, tiered: Any, *, split: str = "plan",
                 overlap: bool = True, graphs: Any = None) -> None:
        self.lm = lm
        self.graphs = graphs  # SuffixGraphs: a fresh hit's new tokens run as captured graphs
        self.tiered = tiered
        self.page_size = int(tiered.page_size)
        self.split = split
        self.overlap = overlap  # load host hits layer by layer under the forward
        layout = lm.kv_layout(self.page_size)
        kv_pages.check_pool(tiered.device_pool.kv, layout.num_layers, layout.num_kv_heads,
                            layout.head_dim, lm.dtype)
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="kvtier-recompute")

    @classmethod
    def build(cls, config: KvtierConfig, lm: CausalLM, *, split: str | None = None,
              graphs: bool = True) -> PrefixCache:
        """The cache the config asks for; ``split`` None: ``engine.store_hit_split``
        (``split_for``); ``graphs`` false skips the per-sequence path's captured suffix
        forwards (the batched engine captures its own, ``suffix_step``)."""
        split = split_for(config, lm) if split is None else split
        from kvtier.cache import TieredCache

        page_size = config.cache.page_size
        layout = lm.kv_layout(page_size)
        namespace = KeyNamespace(lm.name, kv_fingerprint(lm), lm.dtype_name,
                                 layout.fingerprint(), page_size)
        tiered = TieredCache.build(config, layout, namespace, device=str(lm.device))
        return cls(lm, tiered, split=split, graphs=_suffix_graphs(config, lm) if graphs else None)

    @property
    def split(self) -> str:
        return self._split

    @split.setter
    def split(self, value: str) -> None:
        if value not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {value!r}")
        self._split = value

    @property
    def pool(self) -> torch.Tensor:
        return self.tiered.device_pool.kv

    # ---- prefill -----------------------------------------------------------------------------
    def prefill(self, prompt: list[int], salt: str | None,
                report: PrefillReport) -> tuple[Any, torch.Tensor, PrefixState]:
        """The model's cache holding the prompt's KV, the last position's logits, and the state
        ``commit_prompt`` needs (call it once the first token is out; it releases the pins)."""
        started = time.perf_counter()
        hit = self.tiered.match(prompt, salt)
        report.matched_tokens = hit.tokens
        head = self.head_tokens(hit)
        whole = head >= hit.tokens  # nothing to load: the hit runs in the prompt's one forward
        pending = self.tiered.pending_split if 0 < head < hit.tokens else None
        kv = self.lm.new_cache()
        if head and not whole:  # the store reads start before the head's forward is launched
            self.tiered.prefetch(hit, recompute_tokens=head)
        joined = self._start_recompute(prompt[:0 if whole else head], kv)
        try:
            loaded = None if whole else self.load_hit(hit, head)
        finally:
            joined()
        state = PrefixState(salt, loaded)
        if pending is not None:
            state.split = (pending[0], pending[1], started)
        try:
            state.span = span = self.usable_span(loaded, head)
            room = len(prompt) - span[1] + DECODE_ROOM_TOKENS if span else 0
            ticket = getattr(loaded, "ticket", None)
            past = head + kv_pages.append_pages(kv, self.pool, span[2], room,
                                                ticket) if span else head
            past = 0 if whole else past
            reused = 0 if whole else past - head
            if past >= len(prompt):  # the last position must run to give the first token
                kv.crop(len(prompt) - 1 - past)
                reused, past = reused - (past - len(prompt) + 1), len(prompt) - 1
            logits = self._forward(prompt[past:], kv)
            if ticket is not None:  # whatever runs next on this stream sees the landed pages
                ticket.stream_wait()
            self._account(report, hit, head, reused, len(prompt) - past - (head if whole else 0))
            if reused == 0 and head == 0 and len(prompt) >= MIN_OBSERVED_PREFILL_TOKENS:
                self._observe(len(prompt), started)
        except BaseException:
            self.release(state)
            raise
        return kv, logits, state

    def _forward(self, tokens: list[int], kv: Any) -> torch.Tensor:
        """The prompt's rest after the hit: captured graphs where they serve it, else eager."""
        if self.graphs is not None and self.graphs.accepts(kv, len(tokens)):
            logits = self.graphs.forward(tokens, kv)
            if logits is not None:
                return logits
        return self.lm.forward(self._tensor(tokens), kv)

    def commit_prompt(self, state: PrefixState, prompt: list[int], kv: Any) -> None:
        """Commit the prompt's full pages (after the first token went out), release the pins.
        A split's time to this first token teaches the planner how late splits run."""
        if state.split is not None:
            hit_tokens, predicted, started = state.split
            state.split = None
            self.tiered.observe_split(hit_tokens, predicted, time.perf_counter() - started)
        try:
            state.committed_pages = self._commit(prompt, kv, state.salt, state.span)
        finally:
            self.release(state)

    def release(self, state: PrefixState) -> None:
        """Unpin what the prefill's load pinned (idempotent)."""
        loaded, state.loaded, state.span = state.loaded, None, None
        if loaded is not None:
            self.tiered.release(loaded)

    def head_tokens(self, hit: Any) -> int:
        """Tokens at the head of the hit to recompute instead of loading (a page multiple)."""
        if hit.tokens == 0 or self._split == "load":
            return 0
        if self._split == "recompute":
            return hit.tokens
        if not any(hit.tokens_by_tier.get(tier, 0) for tier in STORE_TIERS):
            return 0  # from RAM loading wins outright, and the copy kernels share the GPU's SMs
        planned = int(self.tiered.plan_split(hit))
        return max(0, min(planned - planned % self.page_size, hit.tokens))

    def load_hit(self, hit: Any, head: int) -> Any:
        """``tiered.load`` past ``head``; a whole load with a store part is timed and reported
        (``observe_load``: it teaches the split each tier's fixed cost per load). A split load
        is not: on CUDA its copy waits for the head's forward."""
        started = time.perf_counter()
        loaded = self.tiered.load(hit, recompute_tokens=head, overlap=self.overlap and head == 0)
        tiers = [t for t in STORE_TIERS if hit.tokens_by_tier.get(t, 0)]
        moved = loaded.tokens - loaded.start_tokens
        if head == 0 and tiers and moved > 0:
            tier = max(tiers, key=lambda t: hit.tokens_by_tier[t])
            bytes_per_token = self.lm.kv_layout(self.page_size).bytes_per_token
            self.tiered.observe_load(tier, moved * bytes_per_token, time.perf_counter() - started)
        return loaded

    def _start_recompute(self, head: list[int], kv: Any) -> Callable[[], None]:
        """Start running the head of the hit so that it overlaps the load that follows; returns
        the call that waits for it. On CUDA the forward is only queued here (kernel launches
        return at once), so the GPU computes while the IO workers read the store; the copy
        engine's host -> device copy then waits for it on the device. On the CPU the forward
        runs on a helper thread while this thread waits for the IO workers."""
        if not head:
            return lambda: None
        tokens = self._tensor(head)
        if self.lm.device.type == "cuda":
            self.lm.forward(tokens, kv)
            return lambda: None
        future = self._helper.submit(self.lm.forward, tokens, kv)

        def wait() -> None:
            future.result()
        return wait

    def usable_span(self, loaded: Any, head: int) -> tuple[int, int, list[int]] | None:
        """(first token, end token, device pages) of the loaded KV that continues the head."""
        if loaded is None or loaded.tokens <= head or loaded.start_tokens > head:
            return None
        skip = (head - loaded.start_tokens) // self.page_size
        return head, loaded.tokens, list(loaded.device_page_ids[skip:])

    def _account(self, report: PrefillReport, hit: Any, head: int, reused: int,
                 computed: int) -> None:
        report.cached_tokens = reused
        report.recomputed_hit_tokens = min(head, hit.tokens)
        report.computed_tokens = computed + head
        report.cached_by_tier = _attribute(hit.tokens_by_tier, head, reused)

    def _observe(self, tokens: int, started: float) -> None:
        if self.lm.device.type == "cuda":
            torch.cuda.synchronize(self.lm.device)
        self.tiered.observe_prefill(tokens, time.perf_counter() - started)

    # ---- commit ------------------------------------------------------------------------------
    def _device_prefix(self, tokens: list[int], salt: str | None) -> list[int]:
        """Device page ids of the prefix of ``tokens`` the device tier holds now."""
        return self.tiered.device_prefix(tokens, salt)

    def _commit(self, tokens: list[int], kv: Any, salt: str | None,
                span: tuple[int, int, list[int]] | None) -> int:
        """Commit every full page of ``tokens``: the device tier's pages where it holds them,
        the loaded span's pages, and fresh pages written from ``kv`` for the rest."""
        full = len(tokens) // self.page_size
        if full == 0:
            return 0
        fresh: list[int] = []
        while True:  # allocating may evict unpinned device pages: look again after it
            held = dict(enumerate(self._device_prefix(tokens, salt)[:full]))
            if span is not None:
                first = span[0] // self.page_size
                held.update({first + i: pid for i, pid in enumerate(span[2]) if first + i < full})
            missing = [p for p in range(full) if p not in held]
            if len(fresh) >= len(missing):
                break
            fresh += self.tiered.allocate(len(missing) - len(fresh))
        self.tiered.free(fresh[len(missing):])
        for page, page_id in zip(missing, fresh, strict=False):
            held[page] = page_id
        for start, ids in _runs(missing, fresh[:len(missing)]):
            kv_pages.write_pages(kv, self.pool, start * self.page_size, ids)
        self.tiered.commit(tokens[:full * self.page_size], [held[p] for p in range(full)], salt)
        return full

    def finish(self, state: PrefixState, tokens: list[int], kv: Any, *,
               commit: bool = True) -> None:
        """Commit the full pages generation added beyond the prompt's (``tokens`` are those
        whose KV ``kv`` holds) and drop any pin still held."""
        self.release(state)
        if commit and kv is not None and len(tokens) // self.page_size > state.committed_pages:
            state.committed_pages = self._commit(tokens, kv, state.salt, None)

    # ---- tiers ---------------------------------------------------------------------------------
    def settle(self, timeout_s: float = 120.0) -> bool:
        """Wait until every copy and store write in flight has finished."""
        return bool(self.tiered.drain(timeout_s))

    def drop_tiers(self, tiers: tuple[str, ...]) -> None:
        """Forget what ``tiers`` (device, host) hold, so the next hit comes from a lower tier."""
        self.settle()
        if "device" in tiers and "host" in tiers:
            self.tiered.flush()
            return
        for tier in tiers:
            self.tiered.clear_tier(tier)

    # ---- passthrough ---------------------------------------------------------------------------
    def poll(self) -> None:
        self.tiered.poll()

    def stats(self) -> dict[str, Any]:
        out = self.tiered.stats()
        if self.graphs is not None:
            out["graphs"] = self.graphs.stats()
        return out

    def close(self) -> None:
        self._helper.shutdown(wait=True)
        self.graphs = None  # the static KV and the captured graphs' memory go with it
        self.tiered.close()

    def _tensor(self, tokens: list[int]) -> torch.Tensor:
        return torch.tensor(tokens, dtype=torch.long, device=self.lm.device)


def kv_fingerprint(lm: CausalLM) -> str:
    """The model fingerprint the engine's pages are keyed by: with the deterministic kernels it
    names them too, so pages computed by other kernels (an older build's, or the library's)
    are never served where a hit must repeat a recompute bit for bit."""
    if not lm.deterministic:
        return lm.fingerprint
    from kvtier.engine.invariant import KERNELS

    return f"{lm.fingerprint}+{KERNELS}"


def _suffix_graphs(config: KvtierConfig, lm: CausalLM) -> Any:
    """``SuffixGraphs`` where they can serve (CUDA, the kvtier or the deterministic attention, a
    supported model, ``engine.graph_tokens`` > 0), captured for every bucket now; else None."""
    from kvtier.engine import graphs

    engine = config.engine
    kvtier_attention = engine.attention == "kvtier" or lm.deterministic
    if (engine.graph_tokens <= 0 or not kvtier_attention or lm.device.type != "cuda"
            or graphs.unsupported_reason(lm) is not None):
        return None
    static = graphs.SuffixGraphs(lm, engine.graph_tokens)
    static.warm()
    return static


def _runs(pages: list[int], ids: list[int]) -> list[tuple[int, list[int]]]:
    """Group consecutive prefix pages: [(first page, their device ids), ...]."""
    out: list[tuple[int, list[int]]] = []
    for page, page_id in zip(pages, ids, strict=True):
        if out and out[-1][0] + len(out[-1][1]) == page:
            out[-1][1].append(page_id)
        else:
            out.append((page, [page_id]))
    return out


def _attribute(tokens_by_tier: dict[str, int], head: int, reused: int) -> dict[str, int]:
    """Split the reused span ``[head, head + reused)`` by tier: ``tokens_by_tier`` gives each
    tier's run in prefix order (device first, then host, disk, remote)."""
    out = dict.fromkeys(TIERS, 0)
    lo, end = 0, head + reused
    for tier in TIERS:
        hi = lo + int(tokens_by_tier.get(tier, 0))
        out[tier] = max(0, min(hi, end) - max(lo, head))
        lo = hi
    return out
