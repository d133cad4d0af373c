"""What one rank of ``multi_gpu.py`` runs: one phase, in its own process, torchrun-style env.

Phases (every rank of a world runs the same one; each writes ``rank<r>.json`` under its folder):

- ``write``: prefill the prompts head-parallel and store the rank's head groups through its
  ``TieredCache`` (``heads=`` its share) into the shared ``file://`` store;
- ``read``: a fresh cache per rank loads every prompt from that store (all ranks at once, timed,
  then a same-size copy timed as the device's peak), checks its loaded KV byte for byte against
  the slice of a TP=1 prefill, all-gathers the slices and checks the greedy tokens;
- ``agree``: host-tier-only caches, one rank's tiers cleared and refilled to half the prompt,
  every rank must agree on the half; then the last rank dies between a match and its load and
  the others must error out within the process-group timeout.

Main thread of each rank process (the caches' IO workers run inside).
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kvtier.cache import TieredCache
from kvtier.config import build_config
from kvtier.controller.ranks import torch_min_across_ranks
from kvtier.keys import KeyNamespace
from kvtier.layout import KVLayout
from multi_gpu_model import HeadParallelModel, ModelShape


class Rank:
    """One rank's process group, device, model share and helpers."""

    def __init__(self, opts: dict[str, Any]) -> None:
        self.opts = opts
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        backend = opts["backend"]
        if backend == "nccl":
            self.device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        dist.init_process_group(backend, init_method="env://", rank=self.rank,
                                world_size=self.world,
                                timeout=datetime.timedelta(seconds=opts["pg_timeout_s"]))
        self.shape = ModelShape(**opts["shape"])
        self.model = HeadParallelModel(self.shape, opts["seed"], self.device)
        self.layout = KVLayout(self.shape.layers, self.shape.kv_heads, self.shape.head_dim,
                               "float32", opts["page_size"])
        self.namespace = KeyNamespace("multi-gpu-random", f"seed{opts['seed']}", "float32",
                                      self.layout.fingerprint(), opts["page_size"])
        self.heads = self.layout.head_range_for_rank(self.rank, self.world)

    def gather(self, local: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, dim=dim)

    def cache(self, with_store: bool = True) -> TieredCache:
        share = self.layout.for_heads(self.heads)
        pages = self.opts["prompts"] * (self.opts["prompt_tokens"] // self.opts["page_size"] + 1)
        flags = {"cache.page_size": self.opts["page_size"], "cache.device_pages": 2 * pages,
                 "host.pool_bytes": 4 * pages * share.page_bytes,
                 "controller.prefetch_policy": "wait_complete", "controller.min_prefetch_tokens": 0,
                 "controller.io_workers": 2, "controller.job_deadline_s": 60.0}
        if with_store:
            flags["store.disk_url"] = "file://" + self.opts["store_dir"]
        return TieredCache.build(build_config(env={}, flags=flags), self.layout, self.namespace,
                                 device=str(self.device), collective=torch_min_across_ranks(
                                     device=self.device), heads=self.heads, stores=None
                                 if with_store else {})

    def prompts(self) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(self.opts["seed"] + 1)
        return [torch.randint(0, self.shape.vocab, (self.opts["prompt_tokens"],), generator=gen)
                .to(self.device) for _ in range(self.opts["prompts"])]

    def store_prefill(self, cache: TieredCache, tokens: torch.Tensor, kv: list[Any],
                      pages: int) -> None:
        """Put the first ``pages`` pages of the rank's KV into fresh device pages and commit."""
        p = self.layout.page_size
        ids = cache.allocate(pages)
        stacked = torch.stack([torch.stack(layer) for layer in kv])[:, :, :, :pages * p]
        paged = stacked.permute(0, 1, 3, 2, 4).reshape(
            self.shape.layers, 2, pages, p, self.heads[1] - self.heads[0], self.shape.head_dim)
        cache.device_pool.kv[:, :, torch.tensor(ids, device=self.device)] = paged
        cache.commit(tokens[:pages * p].cpu(), ids)


def loaded_kv(cache: TieredCache, page_ids: list[int], layers: int) -> torch.Tensor:
    """The loaded pages as ``[layers, 2, heads, tokens, head_dim]``."""
    pages = cache.device_pool.kv[:, :, torch.tensor(page_ids, device=cache.device_pool.device)]
    n, p, h, d = pages.shape[2:]
    return pages.reshape(layers, 2, n * p, h, d).permute(0, 1, 3, 2, 4)


def phase_write(r: Rank) -> dict[str, Any]:
    out = {"written_pages": 0}
    with r.cache() as cache:
        for tokens in r.prompts():
            hit = cache.match(tokens.cpu())
            cache.release(cache.load(hit))
            _, kv = r.model.forward(tokens, None, r.heads, r.gather)
            pages = tokens.numel() // r.layout.page_size
            r.store_prefill(cache, tokens, kv, pages)
            out["written_pages"] += pages
        out["drained"] = cache.drain(60.0)
        out["store_records"] = cache.ctx.stores["disk"].stats().pages
    dist.barrier()
    return out


def _copy_peak_gbs(nbytes: int, device: torch.device) -> float:
    """The device's own copy rate for ``nbytes``: host->device from pinned memory on CUDA, a
    plain memcpy on the CPU; best of three, all ranks at once."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def phase_read(r: Rank) -> dict[str, Any]:
    prompts = r.prompts()
    with r.cache() as cache:
        dist.barrier()
        start = time.perf_counter()
        loads = []
        for tokens in prompts:
            loaded = cache.load(cache.match(tokens.cpu()))
            loads.append(loaded)
        if r.device.type == "cuda":
            torch.cuda.synchronize(r.device)
        seconds = time.perf_counter() - start
        share = r.layout.for_heads(r.heads)
        loaded_bytes = sum(x.tokens for x in loads) * share.bytes_per_token
        peak = _copy_peak_gbs(max(loaded_bytes, 1), r.device)
        checks = [_check_prompt(r, cache, tokens, x) for tokens, x in zip(prompts, loads,
                                                                           strict=True)]
        for x in loads:
            cache.release(x)
    return {"heads": list(r.heads), "load_s": seconds, "loaded_bytes": loaded_bytes,
            "load_gbs": loaded_bytes / seconds / 1e9, "copy_peak_gbs": peak, "prompts": checks}


def _check_prompt(r: Rank, cache: TieredCache, tokens: torch.Tensor, loaded: Any) -> dict[str, Any]:
    every = (0, r.shape.kv_heads)
    _, ref_kv = r.model.forward(tokens, None, every)  # the TP=1 prefill
    n = loaded.tokens
    ref = torch.stack([torch.stack(layer) for layer in ref_kv])[:, :, r.heads[0]:r.heads[1], :n]
    mine = loaded_kv(cache, loaded.device_page_ids, r.shape.layers)
    identical = bool(torch.equal(mine.contiguous().view(torch.uint8),
                                 ref.contiguous().view(torch.uint8)))
    full = r.gather(mine.contiguous(), dim=2)
    past = [(full[i, 0], full[i, 1]) for i in range(r.shape.layers)]
    steps = r.opts["greedy_tokens"]
    loaded_tokens = r.model.greedy(tokens[n:], past, steps)
    cold_tokens = r.model.greedy(tokens, None, steps)
    return {"hit_tokens": n, "kv_identical": identical, "greedy_match": loaded_tokens == cold_tokens,
            "greedy": loaded_tokens}


def phase_agree(r: Rank) -> dict[str, Any]:
    tokens = r.prompts()[0]
    pages = tokens.numel() // r.layout.page_size
    out: dict[str, Any] = {}
    with r.cache(with_store=False) as cache:
        _, kv = r.model.forward(tokens, None, r.heads, r.gather)
        r.store_prefill(cache, tokens, kv, pages)
        last = r.rank == r.world - 1
        if last:
            out["flushed"] = cache.flush()
            r.store_prefill(cache, tokens, kv, pages // 2)
        calls = cache.controller.ranks.calls
        start = time.perf_counter()
        hit = cache.match(tokens.cpu())
        loaded = cache.load(hit)
        out.update(local_pages=pages // 2 if last else pages, hit_tokens=hit.tokens,
                   loaded_tokens=loaded.tokens, calls=cache.controller.ranks.calls - calls,
                   agree_s=time.perf_counter() - start)
        cache.release(loaded)
        dist.barrier()
        hit = cache.match(tokens.cpu())
        if last:
            _write(r, out)  # then die between the match and the load, as a crashed rank would
            os._exit(3)
        start = time.perf_counter()
        try:
            cache.load(hit)
            out["after_kill"] = "returned"
        except Exception as exc:  # the expected outcome: the collective fails
            out["after_kill"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        out["after_kill_s"] = time.perf_counter() - start
    return out


PHASES = {"write": phase_write, "read": phase_read, "agree": phase_agree}


def _write(r: Rank, result: dict[str, Any]) -> None:
    path = Path(r.opts["out_dir"]) / f"rank{r.rank}.json"
    path.write_text(json.dumps({"rank": r.rank, "world": r.world, **result}, default=str))


def rank_main(phase: str, opts: dict[str, Any], rank: int, world: int, port: int) -> None:
    """Entry of a spawned rank process: torchrun-style env, run ``phase``, write its JSON."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    torch.set_num_threads(opts["threads"])
    r = None
    try:
        r = Rank(opts)
        _write(r, PHASES[phase](r))
    except Exception:
        path = Path(opts["out_dir"]) / f"rank{rank}.error"
        path.write_text(traceback.format_exc())
    # a dead peer can make process-group teardown block: leave without it
    os._exit(0)
