"""Every difference between the vLLM versions kvtier's plug-ins support, in one place.

Owns the supported range (``SUPPORTED``, checked by ``check_version`` when a connector starts:
vLLM 0.26 up to, not including, 0.34) and one function per difference, so that a new vLLM
release touches this module only:

- ``transfer_groups``: the KV cache groups a connector serves (0.32 marks them with
  ``enable_kv_transfer``; before that, every group);
- ``hit_source``: vLLM's per-source hit accounting (``CacheHitSource``, 0.32 on; None before,
  where vLLM never asks a connector for it);
- ``expected_kv_shape``: the logical per-layer KV shape vLLM's own code says it allocates for a
  layer (0.26: the attention backend's ``get_kv_cache_shape``; 0.32 on: the spec's
  ``compute_layer_kv_cache_shape_bytes``, whose content dimension is in bytes), which
  ``layout`` holds the registered tensors against;
- ``graph_hides_layers``: whether the forward about to run is a full CUDA graph replay, inside
  which vLLM calls no per-layer connector hook (``ForwardContext.cudagraph_runtime_mode``);
  ``full_graph_max_tokens``: the largest step that may replay one (from the compilation
  config), so that the scheduler can mark such steps before any forward context exists;
- ``offloading_plugins_refusal``: why kvtier's plug-ins for vLLM's native offloading (secondary
  tier, eviction policy) cannot load on this vLLM, or "" (they need 0.32's tiering API);
  ``require_offloading_plugins`` raises it before their vLLM imports would fail obscurely.

Imports vLLM lazily inside each function; runs on whichever vLLM thread calls it.
"""

from __future__ import annotations

import re
from typing import Any

from kvtier.errors import ConfigError

#: vLLM versions kvtier's connector supports: ``SUPPORTED[0] <= (major, minor) < SUPPORTED[1]``.
SUPPORTED = ((0, 26), (0, 34))
#: The first vLLM whose offloading tiering API (``Medium``, ``TransferJob``, ``ChunkStatus``,
#: tier factories by ``module_path``) kvtier's secondary tier and policy are written against.
OFFLOADING_PLUGINS_SINCE = (0, 32)


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.32.0+cpu"`` -> ``(0, 32, 0)``; a development or local suffix is ignored."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        raise ConfigError("vLLM version", text, "a release number such as 0.32.0")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def vllm_version() -> tuple[int, int, int]:
    import vllm

    return parse_version(str(vllm.__version__))


def check_version(version: tuple[int, int, int] | None = None) -> tuple[int, int, int]:
    """The running vLLM's version, refused (``ConfigError``) outside ``SUPPORTED``."""
    version = vllm_version() if version is None else version
    low, high = SUPPORTED
    if not low <= version[:2] < high:
        raise ConfigError("vLLM version", ".".join(map(str, version)),
                          f">= {low[0]}.{low[1]} and < {high[0]}.{high[1]} (the versions "
                          "kvtier's connector is built and tested against)")
    return version


def transfer_groups(kv_cache_config: Any) -> list[Any]:
    """The KV cache groups whose KV a connector moves."""
    return [g for g in kv_cache_config.kv_cache_groups if getattr(g, "enable_kv_transfer", True)]


def hit_source(tier: str) -> Any:
    """vLLM's ``CacheHitSource`` for a hit served from kvtier's ``tier`` (None before 0.32)."""
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:
        return None
    return {"device": CacheHitSource.HOST, "host": CacheHitSource.HOST,
            "disk": CacheHitSource.DISK}.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)


def expected_kv_shape(backend: Any, spec: Any, num_blocks: int, cache_dtype: str) -> tuple[int, ...]:
    """The logical shape, in elements, of one layer's KV tensor as vLLM allocates it."""
    get_shape = getattr(backend, "get_kv_cache_shape", None)
    if get_shape is not None:
        return tuple(get_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size,
                               cache_dtype_str=cache_dtype))
    from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes

    if getattr(spec, "state_content_bytes", None) is not None:
        raise ConfigError("KV cache content", f"{spec.state_content_bytes} bytes a head row",
                          "K then V of head_size elements each (no inline scales or padding)")
    *outer, content_bytes = compute_layer_kv_cache_shape_bytes(spec, num_blocks)
    element = spec.dtype.itemsize
    return (*outer, content_bytes // element)


def full_graph_max_tokens(vllm_config: Any) -> int:
    """The most tokens a step may hold and still replay a full CUDA graph (0: this engine
    never replays one: ``enforce_eager``, or a graph mode without full graphs)."""
    if getattr(vllm_config.model_config, "enforce_eager", False):
        return 0
    compilation = vllm_config.compilation_config
    mode = getattr(compilation, "cudagraph_mode", None)
    has_full = getattr(mode, "has_full_cudagraphs", None)
    if mode is None or has_full is None or not has_full():
        return 0
    sizes = getattr(compilation, "cudagraph_capture_sizes", None) or ()
    largest = getattr(compilation, "max_cudagraph_capture_size", None)
    return int(largest or max(sizes, default=0))


def graph_hides_layers(forward_context: Any) -> bool:
    """Whether the coming forward replays a full CUDA graph (no per-layer hooks run in it)."""
    mode = getattr(forward_context, "cudagraph_runtime_mode", None)
    return getattr(mode, "name", "") == "FULL"


def offloading_plugins_refusal(version: tuple[int, int, int] | None = None) -> str:
    """Why kvtier's offloading plug-ins cannot run on this vLLM ("" when they can)."""
    version = vllm_version() if version is None else version
    if version[:2] >= OFFLOADING_PLUGINS_SINCE:
        return ""
    since = ".".join(map(str, OFFLOADING_PLUGINS_SINCE))
    return (f"kvtier's secondary tier and eviction policy for vLLM's native offloading need "
            f"vLLM >= {since} (its tiering API); this is vLLM {'.'.join(map(str, version))}. "
            "Use kvtier's KV connector (KvtierConnector) on this version instead.")


def require_offloading_plugins() -> None:
    """Raise ``ImportError`` saying why, where the offloading plug-ins cannot load."""
    why = offloading_plugins_refusal()
    if why:
        raise ImportError(why)
