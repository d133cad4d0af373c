"""vLLM's real ``Scheduler`` with kvtier's connector, and fabricated model-runner outputs.

In the manner of vLLM's own connector unit tests: no model runs; ``make_scheduler`` builds
vLLM's configs for the tiny model directory and a KV cache config of one full-attention group,
``make_request`` a request with token ids (and a ``cache_salt``), ``runner_output`` the output a
model runner would return for a scheduled step (one sampled token per request), and
``fill_kvtier`` stores a prompt's pages in kvtier's cache directly (known K/V values).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(4))
BLOCK = 32                      # vLLM's block (its CPU backend wants a multiple of 32)
KV_HEADS, HEAD_DIM = 2, 32
_ids = itertools.count()


def make_vllm_config(model: Path, extra: dict[str, Any], *, block_size: int = 32,
                     max_batched: int = 1024, policy: str = "fail", tp: int = 1) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(model=str(model), dtype="float32", seed=0, max_model_len=2048)
    return VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_batched,
                                         max_model_len=2048, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(distributed_executor_backend="uni" if tp == 1 else "mp",
                                       tensor_parallel_size=tp),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=extra, kv_load_failure_policy=policy))


def make_kv_cache_config(block_size: int, num_blocks: int = 256, spec: Any = None,
                         kv_heads: int = KV_HEADS) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = spec or FullAttentionSpec(block_size=block_size, num_kv_heads=kv_heads,
                                     head_size=HEAD_DIM, dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])


def make_scheduler(vllm_config: Any, kv_cache_config: Any) -> Any:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                     structured_output_manager=StructuredOutputManager(vllm_config),
                     block_size=vllm_config.cache_config.block_size, log_stats=True)


def make_request(tokens: list[int], block_size: int, salt: str | None = None,
                 max_tokens: int = 4, kv_transfer_params: Any = None) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra)
    return Request(request_id=f"req-{next(_ids)}", prompt_token_ids=list(tokens),
                   sampling_params=params, pooling_params=None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(block_size, sha256))


def runner_output(scheduler_output: Any, invalid_block_ids: set[int] | None = None,
                  finished_sending: set[str] | None = None, worker_meta: Any = None,
                  finished_recving: set[str] | None = None) -> Any:
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[7] for _ in req_ids],
        kv_connector_output=KVConnectorOutput(invalid_block_ids=invalid_block_ids or set(),
                                              finished_sending=finished_sending,
                                              finished_recving=finished_recving,
                                              kv_connector_worker_meta=worker_meta))


def fill_kvtier(runtime: Any, tokens: list[int], salt: str | None = None, seed: int = 0) -> None:
    """Commit every full page of ``tokens`` to kvtier with seeded K/V values."""
    cache, page = runtime.cache, runtime.page_size
    full = len(tokens) // page
    with runtime.lock:
        ids = cache.allocate(full)
        generator = torch.Generator().manual_seed(seed)
        pool = cache.device_pool.kv
        for page_id in ids:
            pool[:, :, page_id] = torch.randn(pool[:, :, page_id].shape, generator=generator)
        cache.commit(tokens[: full * page], ids, salt)
        cache.drain(5.0)


def disk_scheduler(model: Path, disk: Path) -> Any:
    """The scheduler tests' set-up: a disk tier, an 8 MiB host pool, 64 staging pages,
    ``BLOCK``-token blocks and steps of at most 64 tokens."""
    config = make_vllm_config(model, {"disk_url": f"file://{disk}", "host_pool_bytes": "8MiB",
                                      "staging_pages": 64}, block_size=BLOCK, max_batched=64)
    return make_scheduler(config, make_kv_cache_config(BLOCK))


def ramp(n: int, start: int = 10) -> list[int]:
    """``n`` token ids counting up from ``start`` (wrapping within the tiny vocabulary)."""
    return [start + i % 900 for i in range(n)]


def admit(scheduler: Any, tokens: list[int], salt: str | None = None) -> tuple[Any, Any]:
    """Add a request for ``tokens`` and schedule one step: (request, scheduler output)."""
    request = make_request(tokens, BLOCK, salt)
    scheduler.add_request(request)
    return request, scheduler.schedule()
