"""Lookup: a prompt's hit on every tier, agreed across ranks (``TieredCache.match``).

Owns ``Lookup.match``. The index gives the device and host depths and the store depths it knows;
past what the fast tiers hold, each store is asked which further pages it has (one batched
``contains_prefix`` per store, from memory for the file store), so pages written by another
process or before a restart are found. A store that raises counts as holding nothing.

Per tier the *reach* is how many pages from the root that tier or a faster one holds; the four
reaches are agreed across ranks (``MATCH_CALLS`` collective calls, always made) and the hit is
reported from the agreed values, so every rank sees the same ``Hit.tokens`` and
``Hit.tokens_by_tier``. A store-only part shorter than ``min_prefetch_tokens`` is not offered
(no prefetch starts for it). Nothing is locked or changed. Engine thread only.
"""

from __future__ import annotations

from kvtier.controller.context import CacheContext
from kvtier.controller.handles import TIER_ORDER, Hit
from kvtier.controller.ranks import RankAgreement
from kvtier.index.match import IndexMatch
from kvtier.index.radix import as_token_bytes, salt_bytes
from kvtier.keys import PageKey, Tokens


class Lookup:
    def __init__(self, ctx: CacheContext, ranks: RankAgreement) -> None:
        self.ctx = ctx
        self.ranks = ranks

    def match(self, tokens: Tokens, salt: bytes | str | None = None) -> Hit:
        data, key = as_token_bytes(tokens), salt_bytes(salt)
        local: tuple[tuple[int, ...], tuple[int, int], IndexMatch | None]
        try:
            local = self._local(data, key)
        except Exception:
            self.ctx.count("match_errors_total")
            local = ((0, 0, 0, 0), (0, 0), None)
        reaches, store_ends, match = local
        agreed = [self.ranks.agree(value) for value in reaches]
        if (agreed[3] - agreed[1]) * self.ctx.page_size < self.ctx.config.min_prefetch_tokens:
            if agreed[3] > agreed[1]:
                self.ctx.count("prefetch_total.too_short")
            agreed[2] = agreed[3] = agreed[1]
        by_tier, prev = {}, 0
        for tier, reach in zip(TIER_ORDER, agreed, strict=True):
            by_tier[tier] = (reach - prev) * self.ctx.page_size
            prev = reach
        device_ids = match.ids("device", 0, agreed[0]) if match is not None and agreed[0] else []
        self._count(agreed)
        return Hit(agreed[3] * self.ctx.page_size, by_tier, device_ids, key, self.ctx.page_size,
                   len(data) // 4, data, (agreed[0], agreed[1], agreed[2], agreed[3]), store_ends,
                   _match=match)

    def _local(self, data: bytes, salt: bytes) -> tuple[tuple[int, ...], tuple[int, int],
                                                        IndexMatch]:
        ctx = self.ctx
        match = ctx.index.match(data, salt)
        device = match.depth_of("device")
        fast = max(device, match.depth_of("host"))
        disk_end = remote_end = fast
        if ctx.stores and ctx.has_host and fast < match.prompt_pages:
            keys = ctx.keys(match, match.prompt_pages)
            if "disk" in ctx.stores:
                start = max(fast, match.depth_of("disk"))
                disk_end = start + self._probe("disk", keys[start:])
            remote_end = disk_end
            if "remote" in ctx.stores:
                start = max(disk_end, match.depth_of("remote"))
                remote_end = start + self._probe("remote", keys[start:])
        return (device, fast, disk_end, max(disk_end, remote_end)), (disk_end, remote_end), match

    def _probe(self, tier: str, keys: list[PageKey]) -> int:
        if not keys:
            return 0
        try:
            return self.ctx.stores[tier].contains_prefix(keys)
        except Exception:
            self.ctx.count(f"store_probe_errors_total.{tier}")
            return 0

    def _count(self, agreed: list[int]) -> None:
        ctx = self.ctx
        ctx.count("match_total")
        prev = 0
        for tier, reach in zip(TIER_ORDER, agreed, strict=True):
            ctx.count(f"hit_tokens_total.{tier}", (reach - prev) * ctx.page_size)
            prev = reach
