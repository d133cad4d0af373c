"""Which stored pages an SGLang rank reads and writes: shard identity, page keys, the writer rule.

Owns ``ShardIdentity`` and ``shard_identity()``. SGLang names a page by a hex hash of its token
prefix; every rank of a tensor-parallel group gets the same name for the same tokens, but holds
different bytes (its own KV heads). SGLang's own backends append a rank suffix such as
``_{model}_{tp_rank}_{tp_size}`` to each name. kvtier instead folds everything that changes the
bytes into the key namespace, so a page key is ``SHA256(seed || name)`` with the seed built from:

- the model name and an optional weights fingerprint;
- the stored page format (layers, heads, head dim, dtype, page size; or an opaque pool format);
- the KV heads the rank holds as a range of the model's heads (``heads=4-8/16``), not its rank
  number, so ranks that replicate the same heads (more TP ranks than KV heads) share one page,
  and only the first of them writes it;
- the layers it holds (pipeline stage) and any context-parallel shard;
- for MLA (one latent, the same on every TP rank): no rank at all, so every rank reads the page
  that one writer rank stored (SGLang's ``is_storage_writer``; others skip writes).

Pages are stored in kvtier's canonical byte order whatever the host pool's memory layout, so ranks
whose pools use different layouts (``layer_first``, ``page_first``, ...) share pages. Pure Python,
no torch or SGLang imports; runs on the thread that registers the host pool.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.keys import KeyNamespace, PageKey

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardIdentity:
    """What one rank's stored pages hold; equal identities name byte-identical pages."""

    model: str
    model_fingerprint: str
    page_format: str          # KVLayout.fingerprint() of the rank's share, or "opaque:..."
    dtype: str
    page_size: int
    heads: str                # "4-8/16", or "latent" for MLA
    layers: str               # "0-32"
    extra: str = ""           # pipeline stage, context-parallel shards
    writer: bool = True

    def descriptor(self) -> str:
        text = f"sglang:{self.page_format}:heads={self.heads}:layers={self.layers}"
        return text + (f":{self.extra}" if self.extra else "")

    def seed(self) -> bytes:
        namespace = KeyNamespace(model=self.model or "unnamed", model_fingerprint=self.model_fingerprint,
                                 kv_dtype=self.dtype, layout=self.descriptor(),
                                 page_size=self.page_size)
        return namespace.seed()

    def short_id(self) -> str:
        return self.seed().hex()[:16]


class KeyMapper:
    """SGLang page names to kvtier page keys for one shard (thread-safe: no mutable state)."""

    def __init__(self, identity: ShardIdentity) -> None:
        self.identity = identity
        self._seed = identity.seed()

    def key(self, name: str) -> PageKey:
        return PageKey(hashlib.sha256(self._seed + b"\0" + name.encode("utf-8")).digest())

    def keys(self, names: list[str]) -> list[PageKey]:
        seed = self._seed + b"\0"
        sha = hashlib.sha256
        return [PageKey(sha(seed + n.encode("utf-8")).digest()) for n in names]


def head_share(tp_rank: int, tp_size: int, local_heads: int,
               heads_total: int | None) -> tuple[int, int, int, bool]:
    """(first head, end head, model heads, writes) of a TP rank holding ``local_heads`` heads.

    Without ``heads_total`` the ranks are assumed to split the heads without replication. With
    it, ``tp_size * local_heads / heads_total`` consecutive ranks hold the same heads and only the
    first of them writes.
    """
    if not 0 <= tp_rank < tp_size:
        raise ConfigError("tp_rank", tp_rank, f"a rank in [0, {tp_size})")
    total = heads_total if heads_total is not None else local_heads * tp_size
    held = local_heads * tp_size
    if total % local_heads or held % total:
        raise ConfigError("kvtier.kv_heads_total", heads_total,
                          f"a head count that {tp_size} ranks of {local_heads} heads each can hold")
    replicas = held // total
    first = (tp_rank // replicas) * local_heads
    return first, first + local_heads, total, tp_rank % replicas == 0


def default_fingerprint(model_name: str | None) -> str:
    """The weights fingerprint when none is configured: the checkpoint that SGLang's model name
    points at (SGLang passes the model path, sometimes tagged ``<path>-<pool format>``), by
    ``kvtier.model_identity``'s rule, so that a fine-tune written over the same directory never
    shares pages with the base; "" (pages keyed by the name alone, said in the log) when the
    name is not a checkpoint on this machine (a hub id not downloaded here, a served name)."""
    from kvtier.model_identity import NotACheckpoint, checkpoint_fingerprint

    name = str(model_name or "")
    candidates = [name]
    while "-" in candidates[-1]:
        candidates.append(candidates[-1].rsplit("-", 1)[0])
    for candidate in candidates:
        path = Path(candidate).expanduser()
        if candidate and path.exists():
            try:
                return "ckpt:" + checkpoint_fingerprint(path)
            except (NotACheckpoint, OSError) as exc:
                log.warning("kvtier HiCache backend: %s is not a readable checkpoint (%s); "
                            "pages are keyed by the model name alone", path, exc)
                return ""
    if name:
        log.info("kvtier HiCache backend: model %r is not a checkpoint on this machine; pages "
                 "are keyed by its name alone (set model_fingerprint to tell fine-tunes apart)",
                 name)
    return ""


def shard_identity(storage_config: Any, *, page_format: str, dtype: str, page_size: int,
                   local_heads: int | None, layers: tuple[int, int], model_fingerprint: str = "",
                   heads_total: int | None = None) -> ShardIdentity:
    """The identity of this rank's pages from SGLang's ``HiCacheStorageConfig`` (duck-typed).

    ``local_heads`` is None for MLA and for opaque pools (their pages are keyed per TP rank,
    since nothing says how their bytes split over ranks).
    """
    tp_rank, tp_size = int(storage_config.tp_rank), int(storage_config.tp_size)
    mla = bool(storage_config.is_mla_model)
    writer = bool(getattr(storage_config, "is_storage_writer", True))
    if mla:
        heads = "latent"
    elif local_heads is None:
        heads = f"rank{tp_rank}/{tp_size}"
    else:
        first, end, total, first_replica = head_share(tp_rank, tp_size, local_heads, heads_total)
        heads = f"{first}-{end}/{total}"
        writer = writer and first_replica
    return ShardIdentity(
        model=str(storage_config.model_name or ""),
        model_fingerprint=model_fingerprint,
        page_format=page_format,
        dtype=dtype,
        page_size=page_size,
        heads=heads,
        layers=f"{layers[0]}-{layers[1]}",
        extra=_parallel_extra(storage_config),
        writer=writer,
    )


def _parallel_extra(storage_config: Any) -> str:
    parts = []
    pp_size = int(getattr(storage_config, "pp_size", 1) or 1)
    if pp_size > 1:  # the layer range says which layers; the stage guards against a mismatch
        parts.append(f"pp={storage_config.pp_rank}/{pp_size}")
    cp_size = int(getattr(storage_config, "attn_cp_size", 1) or 1)
    if cp_size > 1:
        parts.append(f"cp={storage_config.attn_cp_rank}/{cp_size}")
    dcp_size = int(getattr(storage_config, "dcp_size", 1) or 1)
    if dcp_size > 1:
        parts.append(f"dcp={storage_config.dcp_rank}/{dcp_size}")
    return ":".join(parts)
