"""The state the controller's parts share: index, pools, copy engine, stores, workers, counters.

Owns ``CacheContext`` (a plain record passed to every controller part, so none of them reaches
for globals) and the small helpers every part needs: page keys of a prompt (continued from the
keys the index already holds), node-boundary locks that survive splits, and the token bytes of
an index node's path. Engine thread only; holds no tensors itself.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.config import ControllerConfig
from kvtier.index.match import IndexMatch
from kvtier.index.radix import RadixIndex
from kvtier.index.residency import Node
from kvtier.keys import KeyNamespace, PageKey, chain_keys
from kvtier.store.base import PageStore

if TYPE_CHECKING:
    from kvtier.controller.rates import RateBook
    from kvtier.controller.workers import IOWorkers
    from kvtier.memory.admission import WriteAdmission
    from kvtier.memory.device_pool import DevicePool
    from kvtier.memory.host_pool import HostPool
    from kvtier.transfer.copy_engine import CopyEngine

RECENT_KEYS = 16  # prompts whose page keys are kept (match hashes them, commit reuses them)


@dataclass
class CacheContext:
    """Everything the controller's parts share (built once by ``TieredCache.build``)."""

    index: RadixIndex
    namespace: KeyNamespace
    config: ControllerConfig
    device_pool: DevicePool
    host_pool: HostPool | None = None          # None: host tier off (and with it every store)
    copy: CopyEngine | None = None             # between the two pools (None without a host)
    workers: IOWorkers | None = None           # None without stores
    admission: WriteAdmission | None = None    # staging ledger for backups (None without stores)
    stores: dict[str, PageStore] = field(default_factory=dict)   # "disk", "remote"
    counters: Counter[str] = field(default_factory=Counter)
    rates: RateBook | None = None              # tier read rates, prefill rate
    host_outside: int = 0          # host pages held by jobs and copies, not by the index
    device_outside: int = 0        # device pages held by host copies (copy_tail), not the index
    recent_keys: OrderedDict[tuple[bytes, bytes], list[PageKey]] = field(
        default_factory=OrderedDict)

    @property
    def page_size(self) -> int:
        return self.index.page_size

    @property
    def step(self) -> int:
        return self.index.page_size * 4

    @property
    def has_host(self) -> bool:
        return self.host_pool is not None and self.host_pool.num_pages > 0

    def keys(self, match: IndexMatch, stop: int) -> list[PageKey]:
        """Keys of prefix pages ``[0, stop)``: the index's for matched pages, hashed beyond.

        Keys depend only on the tokens and the salt, so the last few prompts' keys are kept:
        a request hashes its unindexed pages once, not at match and again at commit.
        """
        known = min(match.pages, stop)
        if stop <= known:
            return match.keys(0, stop)
        memo = (match.salt, match.data)
        cached = self.recent_keys.get(memo)
        if cached is not None and len(cached) >= stop:
            self.recent_keys.move_to_end(memo)
            return cached[:stop]
        out = match.keys(0, known)
        seed = match.last_key() if known else None
        if seed is None:
            seed = self.namespace.seed(match.salt)
        out += chain_keys(match.data[known * self.step:stop * self.step], self.page_size, seed)
        self.recent_keys[memo] = out
        while len(self.recent_keys) > RECENT_KEYS:
            self.recent_keys.popitem(last=False)
        return out

    def lock(self, data: bytes, salt: bytes, pages: int, tier: str) -> Node | None:
        """Lock prefix pages ``[0, pages)`` on ``tier``; returns the node to unlock later."""
        if pages <= 0:
            return None
        node = self.index.boundary(data, pages, salt)
        self.index.lock(node, tier)
        return node

    def lock_on(self, match: IndexMatch, pages: int, tier: str) -> tuple[Node | None, IndexMatch]:
        """``lock`` over a walk already made; also returns the match as it stands after the
        lock (a boundary split changes the path, not what it matched)."""
        node, match = self.index.cut(match, pages)
        if node is not None:
            self.index.lock(node, tier)
        return node, match

    def unlock(self, node: Node | None, tier: str) -> None:
        if node is not None:
            self.index.unlock(node, tier)

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n


def path_of(node: Node) -> tuple[bytes, bytes]:
    """Token bytes and key bytes of the prefix from the root to the end of ``node``."""
    tokens: list[bytes] = []
    keys: list[bytes] = []
    while node.parent is not None:
        tokens.append(node.tokens)
        keys.append(node.keys)
        node = node.parent
    return b"".join(reversed(tokens)), b"".join(reversed(keys))


def split_keys(raw: bytes) -> list[PageKey]:
    return [PageKey(raw[i:i + 32]) for i in range(0, len(raw), 32)]
