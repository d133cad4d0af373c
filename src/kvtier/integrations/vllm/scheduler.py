"""The scheduler half of kvtier's vLLM connector: which tokens to load and which to store.

Owns ``SchedulerSide`` and the per-step ``KvtierConnectorMetadata`` it builds (``LoadSpec``
and ``SaveSpec``, defined in ``specs``). Runs on vLLM's scheduling thread, over request
ids, token ids and block ids only.

A hit is claimed only once it can be delivered: ``get_num_new_matched_tokens`` matches the
prompt in kvtier's index over every tier (keys seeded with the request's ``cache_salt``) and
then *loads* the hit into kvtier's staging pages right away (on the direct path, ``direct``:
pins its host pages, the part only a store held landed there first), so every page has been read from
its store and verified against the tokens it was computed for before vLLM hears a number. A page
that is missing, corrupt or behind a dead store shortens the claim instead of failing the
request later (vLLM 0.32's default ``kv_load_failure_policy`` ends a request on a reported load
error). On the direct path the claim is asynchronous (vLLM's ``load_kv_async``): the request
waits outside the step while the worker copies the held host pages into its blocks beside the
forward, and runs once the worker reports it received. Otherwise the worker half only copies
staged rows into vLLM's blocks, layer by layer, inside the step. On CUDA
the last leg, host tier -> staging pages, is left in flight on kvtier's load stream: the
scheduling thread does not wait for the bus, and the forward waits on the device for each
layer's pages just before it copies them into vLLM's blocks. With a forward left to overlap
(more tokens to compute than a full CUDA graph holds, and more than a page) the copy goes layer
by layer (one copy and one event per layer); otherwise it goes as one copy of every layer, which
crosses the bus faster (both through the copy engines under ``host.copy_path`` auto). Those
pages were verified when they entered the host tier; the copy cannot fail.

Other requests never wait on a store read: when part of a hit is held only by the disk or
Redis tier and the last step ran other requests, the first call starts kvtier's prefetch of
that part into the host tier (on kvtier's IO threads) and answers ``None``, which vLLM 0.32
takes as "ask again later": the request waits while the others keep stepping, and the claim is
made (and the hit staged from the host tier) once the prefetch has landed or the prefetch
policy's wait has run out (``controller.prefetch_policy``; what landed by then is claimed).
Counted ``lookups_deferred_landing``. A store's part measured slower to read than to compute
is not waited for (``pricing``). With nothing else running the read happens on the spot
(within the same policy's wait): no one else waits then, and a thread that polls would take
CPU from the IO threads that read.

For a model whose KV kvtier cannot restore exactly (``ModelShape.refused``: a group that keeps
only the sliding window's blocks, several groups, MLA) no request is served or stored, each
counted ``requests_refused_model_kv``.

A request's prompt is stored once, in the step its prefill completes (every full kvtier page
of it), unless kvtier already held all of it, and again when the request finishes if its
output filled more pages (prompt and output together). Where the workers copy saves inside the
step (``runtime.saves_in_step``: CUDA; and workers in processes of their own) that finished
request's save rides in the next step's metadata with a ``held`` mark: ``request_finished``
keeps its blocks, and the worker reports them free (``get_finished``) in the step that copied
them. On the direct path every finished request with a save keeps its blocks that way (its
saves run beside the forward, and the worker reports the blocks free once they are over).
Otherwise (vLLM's CPU backend in one process) the runtime's saver thread copies after
the step, and ``request_finished`` keeps the blocks until it is over. A preempted request is
stored again once it resumes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvtier.integrations.vllm.compat import hit_source
from kvtier.integrations.vllm.pricing import StepClock, priced_hit
from kvtier.integrations.vllm.rank_steps import RankedSteps
from kvtier.integrations.vllm.runtime import ConnectorRuntime
from kvtier.integrations.vllm.shared_pool import PoolRef
from kvtier.integrations.vllm.specs import LoadSpec, SaveSpec

__all__ = ["KvtierConnectorMetadata", "LoadSpec", "SaveSpec", "SchedulerSide"]

#: ``_stage``'s answer while a store's part of the hit lands (the request waits a step).
LANDING = object()

#: Which vLLM hit source each kvtier tier reports as (kvtier's staging pages are host memory);
#: None before vLLM 0.32, which asks a connector for no hit sources.
TIER_SOURCES: dict[str, Any] = {tier: hit_source(tier)
                                for tier in ("device", "host", "disk", "remote")}


#: A request's ``kv_transfer_params`` key: False keeps kvtier out of that request.
OPT_OUT_KEY = "kvtier_cache"


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    #: Requests vLLM preempted this step: their blocks are reused before the forward.
    preempted: list[str] = field(default_factory=list)
    #: The step is small enough to replay a full CUDA graph: its loads are copied whole before
    #: the forward, not layer by layer from hooks a graph replay would skip.
    whole_loads: bool = False
    #: Finished requests whose blocks vLLM keeps until this step's copies (their saves are
    #: among ``saves``); the workers report them free once they have copied them.
    held: list[str] = field(default_factory=list)
    #: Workers in processes of their own (``rank_steps``): the step's number and the shared
    #: staging pool.
    step: int = 0
    pool: PoolRef | None = None


@dataclass
class _Tracked:
    request: Any
    blocks: list[int] = field(default_factory=list)
    claim: tuple[int, int] | None = None           # tokens [start, end) claimed from kvtier
    sources: dict[Any, int] = field(default_factory=dict)
    by_tier: dict[str, int] = field(default_factory=dict)   # the hit's tokens on each tier
    stored: bool = False
    held: int = 0                                  # prompt tokens kvtier staged (it holds them)
    off: bool = False                              # the request opted out of kvtier
    landing: Any = None                            # its hit, while a store's part lands
    saving: bool = False                           # a save of it was sent to the workers


class SchedulerSide:
    """See the module docstring."""

    def __init__(self, runtime: ConnectorRuntime) -> None:
        self.runtime = runtime
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[LoadSpec] = []
        self._stepping: set[str] = set()   # requests the last step ran (and not finished)
        #: Workers in processes of their own: the steps they still run for kvtier.
        self.ranked = RankedSteps(runtime) if runtime.ranked else None
        #: Finished requests' saves for the next step's workers (their blocks wait for it).
        self._generated: list[SaveSpec] = []
        #: Direct path: finished requests whose blocks vLLM keeps until their saves are over.
        self._held: list[str] = []
        #: vLLM's prefill rate, from the steps this half sees (``pricing``).
        self._clock = StepClock()

    # ---- admission -------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        rt = self.runtime
        tracked = self._tracked.setdefault(request.request_id, _Tracked(request))
        if tracked.off or self._refused(request) or self._opted_out(request):
            tracked.off = True
            return 0, False
        prompt = list(request.prompt_token_ids or ())
        limit = len(prompt) - 1          # vLLM computes at least the last prompt token
        waited = time.perf_counter()
        with rt.lock:
            rt.counts["lookup_lock_wait_us"] += int((time.perf_counter() - waited) * 1e6)
            loaded = rt.staged.get(request.request_id)
            if loaded is None:
                loaded = self._stage(tracked, prompt, request.cache_salt, num_computed_tokens)
            if loaded is LANDING:
                return None, False       # vLLM asks again at a later step
            end = min(loaded.tokens, limit) if loaded is not None else 0
        if end <= num_computed_tokens:
            rt.release_staged(request.request_id)
            tracked.claim = None
            return 0, False
        tracked.claim = (num_computed_tokens, end)
        # The direct path loads beside the forward: the request waits outside the step until
        # the worker reports it received (``WorkerSide.take_received``).
        return end - num_computed_tokens, rt.direct

    def _stage(self, tracked: _Tracked, prompt: list[int], salt: str | None,
               num_computed_tokens: int) -> Any:
        """The request's hit staged in kvtier's device pool, None when there is none to claim,
        or ``LANDING`` while the part only a store holds lands in the host tier (started by
        the first call: the disk or Redis read runs on kvtier's IO threads, not here)."""
        rt, cache = self.runtime, self.runtime.cache
        started = time.perf_counter()
        hit = tracked.landing
        others_run = bool(self._stepping - {tracked.request.request_id})
        if hit is None:
            rt.counts["lookups"] += 1
            hit, declined = priced_hit(cache, cache.match(prompt, salt), prompt, salt,
                                       self._clock.tokens_per_s)
            rt.counts["store_tokens_declined_slower"] += declined
            if min(hit.tokens, len(prompt) - 1) <= num_computed_tokens:
                rt.counts["lookup_us"] += int((time.perf_counter() - started) * 1e6)
                return None
            if others_run:
                cache.prefetch(hit)
        if others_run and cache.landing(hit):
            rt.counts["lookups_deferred_landing"] += tracked.landing is None
            tracked.landing = hit
            rt.counts["lookup_us"] += int((time.perf_counter() - started) * 1e6)
            return LANDING
        tracked.landing = None
        # On CUDA the host -> pool copy is left in flight: the worker waits for each layer on
        # the device as the forward reaches it (wait_for_layer_load). Layer by layer when the
        # tokens left to compute make a forward to overlap; else (a full CUDA graph's worth or
        # less, or at most a page) one copy of every layer, which the copy engines move faster.
        # The whole hit is staged, pages vLLM's own prefix cache holds included: staged pages
        # join kvtier's device tier, where the next request with that prefix and this
        # request's own save find them (skipping them, measured on an H100, made shared-prefix
        # serving slower: benchmarks/results/vllm_serve_h100_skip_ab.txt).
        if rt.direct:       # the host pages themselves, pinned; the worker copies them
            loaded = cache.hold_host(hit)
        else:
            left = len(prompt) - min(hit.tokens, len(prompt) - 1)
            layerwise = left > max(rt.shape.full_graph_tokens, rt.page_size)
            loaded = cache.load(hit, overlap=True, layerwise=layerwise)
        rt.counts["lookup_us"] += int((time.perf_counter() - started) * 1e6)
        rt.counts["matched_tokens"] += hit.tokens
        rt.counts["staged_tokens"] += loaded.tokens
        rt.counts["unverified_or_missing_tokens"] += hit.tokens - loaded.tokens
        tracked.by_tier = dict(hit.tokens_by_tier)
        tracked.sources = _sources(hit.tokens_by_tier, num_computed_tokens,
                                   min(loaded.tokens, len(prompt) - 1))
        tracked.held = loaded.tokens
        rt.staged[tracked.request.request_id] = loaded
        return loaded

    def _refused(self, request: Any) -> bool:
        """The model's KV is one kvtier cannot restore exactly (``ModelShape.refused``)."""
        if not self.runtime.shape.refused:
            return False
        self.runtime.counts["requests_refused_model_kv"] += 1
        return True

    def _opted_out(self, request: Any) -> bool:
        """``kv_transfer_params={"kvtier_cache": False}``: neither look up nor store it."""
        params = request.kv_transfer_params
        value = params.get(OPT_OUT_KEY, True) if isinstance(params, dict) else True
        if not isinstance(value, bool):
            self.runtime.counts["bad_kvtier_cache_params"] += 1   # ignored, counted
            return False
        if not value:
            self.runtime.counts["requests_opted_out"] += 1
        return not value

    def get_external_cache_hit_sources(self, request: Any,
                                       num_external_tokens: int) -> dict[Any, int]:
        tracked = self._tracked.get(request.request_id)
        unspecified = TIER_SOURCES["remote"]
        if not num_external_tokens or tracked is None or not tracked.sources:
            return {unspecified: num_external_tokens} if num_external_tokens else {}
        if sum(tracked.sources.values()) == num_external_tokens:
            return dict(tracked.sources)
        return {unspecified: num_external_tokens}

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        tracked = self._tracked.setdefault(request.request_id, _Tracked(request))
        tracked.blocks = list(blocks.get_block_ids()[0])
        if num_external_tokens == 0 or tracked.claim is None:
            self.runtime.release_staged(request.request_id)
            tracked.claim = None
            return
        start, _ = tracked.claim
        tracked.claim = (start, start + num_external_tokens)
        self.runtime.counts["claimed_tokens"] += num_external_tokens
        for tier, tokens in _tier_tokens(tracked.by_tier, start,
                                         start + num_external_tokens).items():
            self.runtime.counts[f"hit_tokens_{tier}"] += tokens
        self._loads.append(LoadSpec(request.request_id, start, start + num_external_tokens,
                                    tuple(tracked.blocks)))

    # ---- each step -------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> KvtierConnectorMetadata:
        started = time.perf_counter()
        self._clock.step(started, int(scheduler_output.total_num_scheduled_tokens),
                         scheduler_output.num_scheduled_tokens)
        meta = self._build_meta(scheduler_output)
        counts = self.runtime.counts
        counts["meta_builds"] += 1
        counts["meta_build_us"] += int((time.perf_counter() - started) * 1e6)
        return meta

    def _build_meta(self, scheduler_output: Any) -> KvtierConnectorMetadata:
        lock = self.runtime.lock
        if lock.acquire(blocking=False):    # the saver may be committing: it polls then too
            try:
                self.runtime.cache.poll()
            finally:
                lock.release()
        self._stepping = set(scheduler_output.num_scheduled_tokens)
        full_graph = self.runtime.shape.full_graph_tokens
        in_step = bool(self._loads) and not self.runtime.direct   # direct: loaded beside it
        meta = KvtierConnectorMetadata(
            loads=self._loads, preempted=sorted(scheduler_output.preempted_req_ids or ()),
            whole_loads=in_step and 0 < scheduler_output.total_num_scheduled_tokens
            <= full_graph)
        self._loads = []
        for req_id in meta.preempted:       # its save may be cancelled: save it once it resumes
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                tracked.stored = False
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.blocks = list(new.block_ids[0])
                self._maybe_save(meta, tracked, new.num_computed_tokens,
                                 scheduler_output.num_scheduled_tokens.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.blocks = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                tracked.blocks.extend(new_blocks[0])
            self._maybe_save(meta, tracked, cached.num_computed_tokens[i],
                             scheduler_output.num_scheduled_tokens.get(req_id, 0))
        meta.saves.extend(self._generated)
        meta.held = [spec.req_id for spec in self._generated] + self._held
        self._generated, self._held = [], []
        if self.ranked is not None:
            self.ranked.prepare(meta)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """What the workers ran (workers in processes of their own only)."""
        if self.ranked is not None:
            self.ranked.on_output(connector_output.kv_connector_worker_meta)

    def _maybe_save(self, meta: KvtierConnectorMetadata, tracked: _Tracked, computed: int,
                    scheduled: int) -> None:
        request = tracked.request
        prompt = request.prompt_token_ids or ()
        if (tracked.off or tracked.stored or computed + scheduled < len(prompt)
                or self.runtime.shape.refused):
            return
        tracked.stored = True
        full = len(prompt) // self.runtime.page_size * self.runtime.page_size
        if full == 0 or tracked.held >= full:
            return
        block_size = self.runtime.shape.block_size
        blocks = tuple(tracked.blocks[: -(-full // block_size)])
        meta.saves.append(SaveSpec(request.request_id, tuple(prompt[:full]), request.cache_salt,
                                   blocks))
        tracked.saving = True

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        """Store the full pages the generated tokens added (a chat's next turn starts with
        them), then have vLLM keep the blocks (True) while a save still copies out of them
        (or, with workers in processes of their own, until the next step copies them); the
        worker's ``get_finished`` says when they are free."""
        tracked = self._tracked.pop(request.request_id, None)
        self._stepping.discard(request.request_id)
        self.runtime.release_staged(request.request_id)
        if tracked is not None and tracked.landing is not None:   # ended while it landed
            with self.runtime.lock:
                self.runtime.cache.release(tracked.landing)
        if tracked is not None and tracked.stored and not tracked.off and not \
                self.runtime.shape.refused and self._save_generated(request,
                                                                    list(block_ids or ())):
            return True, None
        if tracked is not None and tracked.saving and self.runtime.direct:
            self._held.append(request.request_id)    # its save may still read the blocks
            return True, None
        return self.runtime.saver.hold_blocks(request.request_id), None

    def _save_generated(self, request: Any, block_ids: list[int]) -> bool:
        """Queue a save of every full page of prompt and output whose KV vLLM computed, when
        the output filled at least one page past the prompt's. The saver reads the blocks
        after this step, whose forward has finished (its tokens were sampled)."""
        page, block = self.runtime.page_size, self.runtime.shape.block_size
        prompt = len(request.prompt_token_ids or ())
        computed = min(request.num_computed_tokens, len(request.all_token_ids))
        full = computed // page * page
        if full // page <= prompt // page or -(-full // block) > len(block_ids):
            return False
        spec = SaveSpec(request.request_id, tuple(request.all_token_ids[:full]),
                        request.cache_salt, tuple(block_ids[: -(-full // block)]))
        self.runtime.counts["generated_saves"] += 1
        if self.runtime.saves_in_step:  # the workers copy it next step; vLLM keeps the blocks
            self._generated.append(spec)
            return True
        self.runtime.saver.submit(request.request_id, spec=spec)
        return False


def _tier_tokens(tokens_by_tier: dict[str, int], start: int, end: int) -> dict[str, int]:
    """Tokens of ``[start, end)`` by the kvtier tier that held them (nearest tier first)."""
    out: dict[str, int] = {}
    at = 0
    for tier in ("device", "host", "disk", "remote"):
        span = tokens_by_tier.get(tier, 0)
        overlap = min(end, at + span) - max(start, at)
        if overlap > 0:
            out[tier] = overlap
        at += span
    return out


def _sources(tokens_by_tier: dict[str, int], start: int, end: int) -> dict[Any, int]:
    """Tokens of ``[start, end)`` by the vLLM hit source of the tier that held them."""
    out: dict[Any, int] = {}
    for tier, tokens in _tier_tokens(tokens_by_tier, start, end).items():
        source = TIER_SOURCES[tier]
        out[source] = out.get(source, 0) + tokens
    return out
