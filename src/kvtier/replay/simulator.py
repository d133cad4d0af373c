"""Trace replay through the real ``RadixIndex``: tiers, eviction policies, write policies.

Owns ``ReplayConfig``, ``ReplayResult`` and ``replay``. Bookkeeping only (no model, no bytes):
each trace block is one index page (its id is the page's one "token", so a lookup compares ids
exactly) and each tier's capacity is in pages (tokens / block tokens). Requests run in timestamp
order; for each one:

1. ``match``: the device serves its depth, the host what it holds beyond that, the disk the
   rest of the reach (the tiers are prefix-closed, so each share is a depth from the root);
2. load: pages only on disk land on the host when the host holds the prefix before them
   (disk -> host, the tier rule); every hit page not on the device is promoted to it;
3. compute: the missing pages are inserted on the device (evicting there);
4. ``touch`` the served prefix (hits, recency, every tier's policy). Touching after the insert
   means a node that the request's new branch split at its divergence credits the hit to the
   part that was used, not to the unused tail (which keeps its old recency, as a page-level
   cache would);
5. commit: the write policy copies device pages to the host (``write_through``: all of them;
   ``write_through_selective``: what ``AdmitReturning`` expects to come back — pages seen
   before, the whole of a request that continues an earlier one, fresh pages while most of
   those probed return) and the host backs its
   new pages up to the disk.

The request's path is locked on a tier while that tier allocates, so a request never evicts its
own prefix. A request that carries a cache hint has its device path hinted through the same
``HintBook`` the live cache uses (trace time as its clock; ``hint_share`` bounds a tenant).
Evictions count through the index's ``on_evict`` hook. Main thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.controller.hints import HintBook
from kvtier.errors import ConfigError
from kvtier.index.admit_returning import AdmitReturning
from kvtier.index.eviction import AdmissionPolicy, AdmitAll, EvictionPolicy, make_eviction_policy
from kvtier.index.radix import RadixIndex
from kvtier.index.residency import Node
from kvtier.replay.timing import TimedPolicy, proxy_cost_ns
from kvtier.replay.trace import Trace, TraceRequest

REPLAY_TIERS: tuple[str, ...] = ("device", "host", "disk")
#: write policy -> admission, given the lower tiers' capacity in pages (what a seen-page memory
#: needs to cover: a page seen longer ago than the lower tiers could hold it is not served).
WRITE_POLICIES: dict[str, Callable[[int], AdmissionPolicy]] = {
    "write_through": lambda pages: AdmitAll(),
    "write_through_selective": lambda pages: AdmitReturning(max(pages, 1))}


@dataclass(frozen=True)
class ReplayConfig:
    """Tier capacities in tokens (0: tier off; the device must be on), policies by name."""

    device_tokens: int
    host_tokens: int = 0
    disk_tokens: int = 0
    policy: str = "lru"
    write_policy: str = "write_through"
    block_tokens: int = 512
    hint_share: float = 0.25
    #: Page identities spread like live page keys (``TraceRequest.block_bytes(spread=True)``),
    #: as the live cache's content-hash keys are; False replays the trace's raw block ids.
    spread_ids: bool = True

    def __post_init__(self) -> None:
        if self.device_tokens < self.block_tokens:
            raise ConfigError("device_tokens", self.device_tokens,
                              f"at least one block ({self.block_tokens} tokens)")
        if min(self.host_tokens, self.disk_tokens) < 0:
            raise ConfigError("tier tokens", (self.host_tokens, self.disk_tokens), ">= 0")
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError("write_policy", self.write_policy, ", ".join(WRITE_POLICIES))
        if not 0.0 <= self.hint_share <= 1.0:
            raise ConfigError("hint_share", self.hint_share, "a share within [0, 1]")

    def pages(self, tier: str) -> int:
        return getattr(self, f"{tier}_tokens") // self.block_tokens

    def tiers(self) -> tuple[str, ...]:
        return tuple(t for t in REPLAY_TIERS if self.pages(t) > 0)

    def label(self) -> str:
        return " + ".join(f"{t} {getattr(self, f'{t}_tokens') / 1e6:g}M" for t in self.tiers())


@dataclass
class ReplayResult:
    """What one replay served, moved and evicted (tokens and pages)."""

    config: ReplayConfig
    requests: int = 0
    input_tokens: int = 0
    served_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REPLAY_TIERS, 0))
    evicted_pages: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REPLAY_TIERS, 0))
    written_pages: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REPLAY_TIERS, 0))
    promoted_pages: dict[str, int] = field(default_factory=dict)
    uncached_requests: int = 0
    hints: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0
    policy_timing: dict[str, Any] | None = None
    #: per request: (input tokens, tokens served by the device, by the host, by the disk)
    per_request: list[tuple[int, int, int, int]] = field(default_factory=list, repr=False)

    @property
    def served_share(self) -> float:
        return sum(self.served_tokens.values()) / max(self.input_tokens, 1)

    def share(self, tier: str) -> float:
        return self.served_tokens[tier] / max(self.input_tokens, 1)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["per_request"]
        out["label"] = self.config.label()
        out["served_share"] = self.served_share
        out["share_by_tier"] = {t: self.share(t) for t in REPLAY_TIERS}
        return out


class _Replayer:
    """One replay's index and counters (kept out of ``replay`` to keep functions short)."""

    def __init__(self, config: ReplayConfig, timed: bool,
                 policy_factory: Callable[[], EvictionPolicy] | None) -> None:
        self.config = config
        self.tiers = config.tiers()
        self.result = ReplayResult(config)
        self.admission = WRITE_POLICIES[config.write_policy](
            config.pages("host") + config.pages("disk"))
        make = policy_factory or (lambda: make_eviction_policy(config.policy))
        self.policies: dict[str, EvictionPolicy] = {t: make() for t in self.tiers}
        if timed:
            self.policies = {t: TimedPolicy(p) for t, p in self.policies.items()}
        self.index = RadixIndex(1, capacities={t: config.pages(t) for t in self.tiers},
                                policies=self.policies, on_evict=self._evicted)
        self.promoted = self.result.promoted_pages
        self.hints = HintBook(self.index, config.hint_share, self._count_hint)

    def _count_hint(self, name: str, n: int) -> None:
        self.result.hints[name] = self.result.hints.get(name, 0) + n

    def _evicted(self, node: Node, tier: str) -> None:
        self.result.evicted_pages[tier] += node.pages

    def _depth(self, match: Any, tier: str) -> int:
        return match.depth_of(tier) if tier in self.tiers else 0

    def serve(self, request: TraceRequest) -> None:
        data = request.block_bytes(self.config.spread_ids)
        match = self.index.match(data)
        d, h, k = (self._depth(match, t) for t in REPLAY_TIERS)
        reach = max(d, h, k)
        self._count_served(request, d, max(d, h), reach)
        if "host" in self.tiers and h >= d and k > h:
            self._bump(self.promoted, "disk->host", self._put(data, match, "host", h, k))
        if self._put(data, match, "device", d, len(request.blocks)):
            self._bump(self.promoted, "host->device", h - d)
            self._bump(self.promoted, "disk->device", k - max(h, d))
        elif len(request.blocks) > d:
            self.result.uncached_requests += 1
        if reach:
            self.index.touch(self.index.match(data[:4 * reach]))
        self._hint(request, data, len(request.blocks) - d)
        self._write_down(data)

    def _hint(self, request: TraceRequest, data: bytes, new_pages: int) -> None:
        now = request.timestamp_ms / 1000.0
        self.hints.observe(max(new_pages, 0), now)
        if request.hint is not None:
            path = [node for node, _ in self.index.match(data).path]
            self.hints.apply(path, request.hint, request.tenant.encode(), now)

    @staticmethod
    def _bump(counter: dict[str, int], key: str, pages: int) -> None:
        if pages > 0:
            counter[key] = counter.get(key, 0) + pages

    def _count_served(self, request: TraceRequest, d: int, dh: int, reach: int) -> None:
        bt = self.config.block_tokens
        on_device = request.served_tokens(d, bt)
        on_host = request.served_tokens(dh, bt) - on_device
        on_disk = request.served_tokens(reach, bt) - on_device - on_host
        served = self.result.served_tokens
        served["device"] += on_device
        served["host"] += on_host
        served["disk"] += on_disk
        self.result.per_request.append((request.input_tokens, on_device, on_host, on_disk))
        self.result.input_tokens += request.input_tokens
        self.result.requests += 1

    def _put(self, data: bytes, match: Any, tier: str, start: int, stop: int) -> int:
        """Put pages ``[start, stop)`` on ``tier``, allocating (and so evicting) there with the
        request's path locked; returns the pages put (0 if the tier cannot make room)."""
        if stop <= start:
            return 0
        anchor = match.path[-1][0] if match.path else None
        self.index.lock(anchor, tier)
        try:
            if not self.index.can_allocate(tier, stop - start):
                return 0
            ids = self.index.allocate(tier, stop - start)
            done = self.index.insert(data, tier=tier, ids=ids, start=start, stop=stop,
                                     strict=False)
            self.index.free(tier, done.unused_ids)
        finally:
            self.index.unlock(anchor, tier)
        return done.taken

    def _write_down(self, data: bytes) -> None:
        """Copy device pages to the host through admission, then host pages to the disk."""
        if "host" not in self.tiers:
            return
        match = self.index.match(data)
        admitted = self.admission.admitted_pages(match.path, match.depth_of("device"))
        written = self.result.written_pages
        written["host"] += self._put(data, match, "host", match.depth_of("host"), admitted)
        if "disk" in self.tiers:
            match = self.index.match(data)
            written["disk"] += self._put(data, match, "disk", match.depth_of("disk"),
                                         match.depth_of("host"))


def replay(trace: Trace, config: ReplayConfig, *, timed: bool = False,
           progress: Callable[[int], None] | None = None,
           policy_factory: Callable[[], EvictionPolicy] | None = None) -> ReplayResult:
    """Replay ``trace`` through a fresh index built from ``config`` (``policy_factory``, if
    given, makes each tier's policy instead of ``config.policy``)."""
    if trace.block_tokens != config.block_tokens:
        raise ConfigError("block_tokens", config.block_tokens,
                          f"the trace's block size ({trace.block_tokens})")
    runner = _Replayer(config, timed, policy_factory)
    start = time.perf_counter()
    for request in trace:
        runner.serve(request)
        if progress is not None:
            progress(1)
    runner.result.elapsed_s = time.perf_counter() - start
    runner.index.check_integrity()
    if timed:
        probe = proxy_cost_ns()
        runner.result.policy_timing = {t: p.report(probe) for t, p in runner.policies.items()
                                       if isinstance(p, TimedPolicy)}
    return runner.result
