"""kvtier configuration: one tree of frozen dataclasses, built once and passed down.

Owns the config schema (every field with its default, its help text and what it allows) and the
loader that layers sources in a fixed order: defaults, then an optional YAML file, then
``KVTIER_<SECTION>__<FIELD>`` environment variables, then command-line flags
(``--section.field VALUE``, plus a few short aliases such as ``--model``; ``config_flags`` adds
them to a parser). Field help doubles as CLI help. Sizes and URLs are read by ``units``. Built on
the main thread at start-up; the result is immutable and safe to share.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, SupportsFloat, SupportsIndex

from kvtier.errors import ConfigError
from kvtier.units import parse_size, redact_url

ENV_PREFIX = "KVTIER_"


def opt(default: Any, help: str, *, choices: tuple[str, ...] | None = None,
        minimum: float | None = None, maximum: float | None = None, size: bool = False,
        secret: bool = False, alias: str | None = None) -> Any:
    """A config field: ``help`` is the CLI help; ``size`` accepts '4GiB'-style byte counts."""
    meta = {"help": help, "choices": choices, "minimum": minimum, "maximum": maximum,
            "size": size, "secret": secret, "alias": alias}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class EngineConfig:
    """The model and the reference engine that `kvtier serve` runs."""

    model: str = opt("tiny-llama", "Model: a Hugging Face model directory, or a preset "
                     "(tiny-llama, tiny-qwen2, llama3-8b-shape, qwen2.5-7b-shape).", alias="--model")
    device: str = opt("auto", "Device to run the model on.", choices=("auto", "cpu", "cuda"),
                      alias="--device")
    dtype: str = opt("auto", "Model and KV dtype (auto: bfloat16 on cuda, float32 on cpu).",
                     choices=("auto", "float32", "bfloat16", "float16"), alias="--dtype")
    attention: str = opt("kvtier", "Attention kernels: kvtier (split-KV Triton kernels for a "
                         "few new tokens over a long past on CUDA, sdpa otherwise) or sdpa.",
                         choices=("kvtier", "sdpa"))
    prefill_attention: str = opt("auto", "Prompt attention of the paged forwards on CUDA: fa3 "
                                 "(FlashAttention 3 from vLLM's wheel; Hopper, bf16/fp16, "
                                 "head_dim 128, not engine.deterministic), triton (kvtier's) or "
                                 "auto (fa3 where it fits). H100, 8B, 32k: recompute 1.24-1.34 "
                                 "vs 1.43 s (fa3 vs triton); figures in docs/benchmarks.md.",
                                 choices=("auto", "triton", "fa3"))
    graph_tokens: int = opt(8192, "0 turns off the captured (CUDA graph) forwards of a hit's "
                            "suffix. The server's engine captures them over its paged pool "
                            "(any past up to the model's positions); the per-sequence path "
                            "serves pasts up to this many tokens from a static KV of that size "
                            "(1 GiB for an 8B model at 8192). CUDA only.", minimum=0)
    deterministic: str = opt("auto", "Batch-invariant kernels in every forward (matmuls, norms, "
                             "attention in fixed 256-key slices): a hit's logits are "
                             "bit-identical to a recompute's, so its greedy tokens are too. "
                             "Without them library matmuls round by a forward's row count and "
                             "8B-shape hits changed greedy tokens on an H100. Cost there "
                             "(llama3-8b-shape, bf16): 1.4x the recompute TTFT at 4k tokens, "
                             "0.78x the throughput. auto: on with CUDA, off on the CPU (where "
                             "they need the Triton interpreter).",
                             choices=("auto", "true", "false"))
    store_hit_split: str = opt("auto", "How a hit with a disk or Redis part is served. plan: "
                               "the planner recomputes its head while the tail is read (a "
                               "sooner first token); load: loaded whole; auto: plan under "
                               "engine.deterministic, load otherwise. Library matmuls round a "
                               "row by the forward's row count, so outside the deterministic "
                               "mode a recomputed head is not the stored pages' bytes and "
                               "greedy answers can change (bf16, 7B shapes).",
                               choices=("auto", "plan", "load"))
    decode_graph_batch: int = opt(64, "Largest batch of decode-only steps replayed as CUDA "
                                  "graphs (captured at batch buckets 1, 2, 4, ... up to it; "
                                  "larger steps run eagerly). 0: no decode graphs. CUDA only.",
                                  minimum=0)
    decode_ahead: bool = opt(True, "Queue each greedy decode step from its captured graph "
                             "before the step in flight hands its tokens to the host, so the "
                             "GPU does not wait for the engine thread between decode steps "
                             "(needs decode graphs; sampled requests step one at a time). On: "
                             "on an H100 it cut the inter-token latency at batch 16 from 9.6 to "
                             "8.5 ms and raised throughput 3-4% (benchmarks/results/"
                             "engine_vs_vllm_h100_ahead_chunk16k.*); the same tokens either way.")
    max_new_tokens: int = opt(256, "Default cap on generated tokens per request.", minimum=1)
    max_running: int = opt(16, "Sequences generated at once, in one forward per step; others "
                           "wait in the fair queue.", minimum=1, alias="--max-running")
    prefill_chunk_tokens: int = opt(8192, "Prompt tokens all prefills of one step run at most, "
                                    "beside the decodes (a long prompt is run in chunks).",
                                    minimum=1)
    seed: int = opt(0, "Seed for random-weight presets, so every process builds the same model.",
                    minimum=0)


@dataclass(frozen=True)
class CacheConfig:
    """The tiered cache itself: on or off, page size, the device tier and its eviction policy."""

    enabled: bool = opt(True, "Use the tiered cache (false: the same engine with kvtier off, the "
                        "baseline).")
    page_size: int = opt(64, "Tokens per page, the unit of storage.", minimum=1, maximum=4096,
                         alias="--page-size")
    device_pages: int = opt(0, "Pages in the device pool (0: size from free device memory; "
                            "left unset on the CPU, kvtier serve holds engine.max_running full "
                            "contexts of the model, at most 64 MiB).", minimum=0)
    device_memory_fraction: float = opt(0.3, "Share of free device memory for the device pool "
                                        "when device_pages is 0.", minimum=0.01, maximum=0.95)
    eviction_policy: str = opt("shadow", "Which pages the device and host tiers keep: "
                               "shadow (LRU unless miniature simulations prove a head start "
                               "for runs that came back), lru (the reference), lrfu, reuse, "
                               "retention.",
                               choices=("shadow", "lru", "lrfu", "reuse", "retention"))


@dataclass(frozen=True)
class HostConfig:
    """The pinned host tier, the process's pinned-memory budget and how pages cross the bus."""

    pool_bytes: int = opt(2 << 30, "Bytes of the host (pinned) page pool; 0 turns the host tier "
                          "off. Left unset, kvtier serve sizes it to the model (twice the "
                          "device tier's full contexts), at most this default.", minimum=0,
                          size=True, alias="--host-pool-bytes")
    pinned_budget_bytes: int = opt(8 << 30, "Process-wide limit on pinned host bytes (host pool, "
                                   "read ring, staging). Set it from the machine's real limit.",
                                   minimum=0, size=True)
    layout: str = opt("page_first", "Host pool layout.", choices=("page_first", "layer_first"))
    copy_path: str = opt("auto", "How pages cross the bus: kernel (UVA copy kernels), "
                         "copy_engine (the GPU's copy engines through device staging: no SMs "
                         "used; needs page_first and a CUDA 12.8+ driver) or auto (copy engines "
                         "for loads, whose UVA reads ran at 33-51 GB/s by host where the copy "
                         "engines held 55 on an H100; kernels for stores).",
                         choices=("auto", "kernel", "copy_engine"))
    store_programs: int = opt(16, "Grid cap of the device->host copy kernels (write-through "
                              "and write-back copies); 0: one program per SM. A store runs "
                              "beside the forward, which wants every SM; on the H200 16 "
                              "programs store at the bus rate as one per SM does.", minimum=0)
    load_programs: int = opt(16, "Grid cap of the host->device copy kernels that load a hit "
                             "layer by layer beside the forward (copy_path kernel, or auto "
                             "without copy engines); 0: one program per SM. The "
                             "forward that overlaps the load wants the SMs; a hit that leaves "
                             "almost nothing to compute (a whole prompt served from the host "
                             "tier) is bus-bound and loads fastest on every SM.", minimum=0)
    copy_staging_bytes: int = opt(64 << 20, "Device staging per direction the copy engines "
                                  "use (at least one page; auto: loads only).",
                                  minimum=1 << 20, size=True)
    prefetch_share: float = opt(0.5, "Share of the host pool reserved for prefetch landing; the "
                                "rest bounds write-through staging.", minimum=0.0, maximum=1.0)
    read_ring_slots: int = opt(0, "Pinned page buffers that storage reads land in (0: planner).",
                               minimum=0)


@dataclass(frozen=True)
class StoreConfig:
    """The store tiers below the host tier: a local disk (`file://`) and a shared Redis (`redis://`)."""

    disk_url: str = opt("", "Disk tier URL, e.g. file:///var/cache/kvtier (empty: off).",
                        alias="--disk")
    disk_max_bytes: int = opt(64 << 30, "Cap on disk tier bytes; older pages are evicted past it.",
                              minimum=0, size=True, alias="--disk-max-bytes")
    disk_min_free_bytes: int = opt(1 << 30, "Keep at least this much free space on the disk's "
                                   "filesystem.", minimum=0, size=True)
    remote_url: str = opt("", "Remote tier URL, e.g. redis://:password@host:6379/0 (empty: off).",
                          secret=True, alias="--redis")
    remote_ttl_s: int = opt(0, "Expiry of remote pages in seconds (0: none; rely on maxmemory).",
                            minimum=0)
    remote_timeout_s: float = opt(1.0, "Deadline of every remote call; past it the call is a "
                                  "miss or a refused write.", minimum=0.001, maximum=60.0)


@dataclass(frozen=True)
class ControllerConfig:
    """When pages move between tiers: write and prefetch policies, IO threads, deadlines, cache hints."""

    write_policy: str = opt("write_through", "When device pages get a host copy.",
                            choices=("write_through", "write_through_selective", "write_back"),
                            alias="--write-policy")
    prefetch_policy: str = opt("timeout", "How long a request waits for store pages to land.",
                               choices=("best_effort", "wait_complete", "timeout"),
                               alias="--prefetch-policy")
    prefetch_timeout_base_s: float = opt(0.05, "Prefetch budget: fixed part, seconds.", minimum=0.0)
    prefetch_timeout_per_1k_tokens_s: float = opt(0.02, "Prefetch budget: seconds per 1k tokens "
                                                  "to fetch.", minimum=0.0)
    prefetch_timeout_max_s: float = opt(2.0, "Prefetch budget cap, seconds.", minimum=0.0)
    min_prefetch_tokens: int = opt(256, "No prefetch for store hits shorter than this.", minimum=0)
    io_workers: int = opt(4, "Threads moving pages between the host tier and the stores.",
                          minimum=1, maximum=256)
    io_queue_depth: int = opt(1024, "Bound on queued IO jobs; past it jobs are refused.",
                              minimum=1)
    job_deadline_s: float = opt(5.0, "Deadline of one IO job.", minimum=0.001)
    close_flush_s: float = opt(20.0, "Under write_back, how long closing the cache (a graceful "
                               "stop) may spend backing up to the stores the pages only memory "
                               "holds; what is left is logged as lost (0: no flush).",
                               minimum=0.0)
    hint_share: float = opt(0.25, "Most of the device tier one tenant's cache hints "
                            "(prompt_cache_retention, cache_control) may protect; 0: hints off.",
                            minimum=0.0, maximum=1.0)


@dataclass(frozen=True)
class ServerConfig:
    """`kvtier serve`'s HTTP server: address, keys, limits, logs and KV events."""

    host: str = opt("127.0.0.1", "Address to bind (loopback by default).", alias="--host")
    port: int = opt(8000, "Port to listen on.", minimum=0, maximum=65535, alias="--port")
    admin_key: str = opt("", "Bearer key of the admin API (empty: admin API disabled).",
                         secret=True)
    api_key: str = opt("", "Bearer key of the OpenAI routes (empty: open).", secret=True,
                       alias="--api-key")
    served_model_name: str = opt("", "Names the API serves the model under, comma-separated "
                                 "(empty: the model's name); answers carry the first.",
                                 alias="--served-model-name")
    max_model_len: int = opt(0, "Longest sequence accepted, prompt plus generated tokens (0: "
                             "the model's positions; more is refused at start).", minimum=0,
                             alias="--max-model-len")
    log_level: str = opt("info", "Level of the server's log (kvtier and uvicorn).",
                         choices=("debug", "info", "warning", "error", "critical"),
                         alias="--log-level")
    max_prompt_tokens: int = opt(32768, "Longest prompt accepted.", minimum=1)
    max_body_bytes: int = opt(4 << 20, "Largest request body accepted.", minimum=1, size=True)
    max_concurrent_requests: int = opt(64, "Requests with a whole body queued or running at "
                                       "once; past it 429.", minimum=1)
    max_connections_per_client: int = opt(256, "Open connections per client address; one more "
                                          "closes that client's oldest connection still "
                                          "sending a request, or gets 429 when none is.",
                                          minimum=1)
    header_timeout_s: float = opt(10.0, "Seconds a connection has to send whole request "
                                  "headers (from its opening or its previous answer); past it "
                                  "408 and closed. 0: no limit.", minimum=0.0)
    body_timeout_s: float = opt(60.0, "Seconds a request has to send its whole body after its "
                                "headers; past it 408.", minimum=0.001)
    stats_interval_s: float = opt(10.0, "Seconds between the server's stats log lines "
                                  "(throughput, queue, hit rate and pages per tier); 0: off.",
                                  minimum=0.0)
    kv_events_endpoint: str = opt("", "ZMQ endpoint for KV events in vLLM's format (empty: "
                                  "off). tcp://*:5557 binds; tcp://host:5557 connects to a "
                                  "subscriber that binds.", alias="--kv-events")
    kv_events_topic: str = opt("", "Topic frame of every KV event message (llm-d reads "
                               "kv@<pod>@<model>).")
    kv_events_replay_endpoint: str = opt("", "ZMQ ROUTER endpoint (bound) answering replay "
                                         "requests (empty: no replay).")
    kv_events_buffer_batches: int = opt(10000, "Published batches kept for replay.", minimum=1)
    kv_events_queue_events: int = opt(100000, "Events waiting for the publisher; past it the "
                                      "oldest are dropped (counted).", minimum=1)
    kv_events_block_size: int = opt(0, "Tokens per block in KV events (0: the page size; else a "
                                    "divisor of it, the router's block size).", minimum=0)


@dataclass(frozen=True)
class KvtierConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    host: HostConfig = field(default_factory=HostConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)


SECTIONS: tuple[str, ...] = tuple(f.name for f in fields(KvtierConfig))

def setting_name(path: str) -> str:
    """How a user writes a setting: '--disk (store.disk_url)', or 'store.x' without an alias."""
    alias = dict(iter_fields())[path].metadata.get("alias")
    return f"{alias} ({path})" if alias else path


def iter_fields() -> Iterator[tuple[str, dataclasses.Field[Any]]]:
    """Every leaf field as ('section.name', Field), in schema order."""
    for section in fields(KvtierConfig):
        for leaf in fields(section.type if isinstance(section.type, type) else _section_type(section.name)):
            yield f"{section.name}.{leaf.name}", leaf


def _section_type(name: str) -> type:
    return type(getattr(KvtierConfig(), name))


def _coerce(path: str, f: dataclasses.Field[Any], raw: object) -> Any:
    """Convert ``raw`` (text from env/flags, or a YAML scalar) to the field's type and check it."""
    meta = f.metadata
    kind: type[object] = type(f.default)
    value: Any
    if kind is bool:
        if isinstance(raw, bool):
            value = raw
        elif str(raw).strip().lower() in ("1", "true", "yes", "on"):
            value = True
        elif str(raw).strip().lower() in ("0", "false", "no", "off"):
            value = False
        else:
            raise ConfigError(path, raw, "true or false")
    elif kind is int:
        if isinstance(raw, bool):
            raise ConfigError(path, raw, "an integer")
        if isinstance(raw, int):
            value = raw
        elif meta.get("size"):
            value = parse_size(str(raw))
            if value is None:
                raise ConfigError(path, raw, "a byte count such as 1073741824, 512MiB or 4GB")
        else:
            try:
                value = int(str(raw).strip())
            except ValueError:
                raise ConfigError(path, raw, "an integer") from None
    elif kind is float:
        try:
            if not isinstance(raw, (str, bytes, SupportsFloat, SupportsIndex)):
                raise TypeError(type(raw).__name__)
            value = float(raw)
        except (TypeError, ValueError):
            raise ConfigError(path, raw, "a number") from None
        if value != value:  # NaN
            raise ConfigError(path, raw, "a number")
    else:
        if not isinstance(raw, (str, int, float)) or isinstance(raw, bool):
            raise ConfigError(path, raw, "a string")
        value = str(raw)
    _check_bounds(path, meta, value)
    return value


def _check_bounds(path: str, meta: Mapping[str, Any], value: Any) -> None:
    choices = meta.get("choices")
    if choices and value not in choices:
        raise ConfigError(path, value, "one of " + ", ".join(choices))
    lo, hi = meta.get("minimum"), meta.get("maximum")
    if lo is not None and hi is not None and not lo <= value <= hi:
        raise ConfigError(path, value, f"a value from {lo} to {hi}")
    if lo is not None and value < lo:
        raise ConfigError(path, value, f"a value >= {lo}")
    if hi is not None and value > hi:
        raise ConfigError(path, value, f"a value <= {hi}")


def read_yaml(path: str | Path) -> dict[str, object]:
    import yaml  # lazy: only needed when a file is given

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("config file", str(path), f"a readable YAML file ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("config file", str(path), f"valid YAML ({exc})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config file", str(path), "a mapping of sections to fields")
    flat: dict[str, object] = {}
    for section, body in data.items():
        if section not in SECTIONS:
            raise ConfigError(str(section), "(section)", "one of " + ", ".join(SECTIONS))
        if not isinstance(body, dict):
            raise ConfigError(str(section), body, "a mapping of fields")
        for name, value in body.items():
            flat[f"{section}.{name}"] = value
    return flat


def read_env(env: Mapping[str, str]) -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in env.items():
        if not key.startswith(ENV_PREFIX) or "__" not in key:
            continue
        section, _, name = key[len(ENV_PREFIX):].lower().partition("__")
        flat[f"{section}.{name}"] = value
    return flat


def build_config(file: str | Path | None = None, env: Mapping[str, str] | None = None,
                 flags: Mapping[str, object] | None = None) -> KvtierConfig:
    """Defaults < YAML file < ``KVTIER_SECTION__FIELD`` env < flags ({'section.field': value})."""
    known = dict(iter_fields())
    layers: list[tuple[str, dict[str, object]]] = []
    if file:
        layers.append(("file", read_yaml(file)))
    layers.append(("env", read_env(os.environ if env is None else env)))
    layers.append(("flags", dict(flags or {})))
    chosen: dict[str, Any] = {}
    for _source, values in layers:
        for path, raw in values.items():
            if path not in known:
                raise ConfigError(path, raw, "a known field: " + ", ".join(known))
            chosen[path] = _coerce(path, known[path], raw)
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for path, value in chosen.items():
        section, name = path.split(".", 1)
        sections[section][name] = value
    return KvtierConfig(**{name: _section_type(name)(**vals) for name, vals in sections.items()})


def to_dict(config: KvtierConfig, *, redact: bool = True) -> dict[str, dict[str, object]]:
    """The config as nested plain data; secrets are redacted unless ``redact`` is False."""
    out: dict[str, dict[str, object]] = {}
    for path, f in iter_fields():
        section, name = path.split(".", 1)
        value = getattr(getattr(config, section), name)
        if redact and f.metadata.get("secret") and value:
            value = redact_url(value) if "://" in str(value) else "***"
        out.setdefault(section, {})[name] = value
    return out
