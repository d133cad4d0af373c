"""One vLLM engine run for the vLLM plug-in's end-to-end tests and benchmark (a subprocess each).

``python scenario.py SPEC.json OUT.json``: builds ``vllm.LLM`` on the CPU backend in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, capped KV memory, eager), optionally with kvtier's
connector (``"connector": {...}``, its options) or one that does nothing (``"connector":
"noop"``, ``noop_connector``), generates greedily for the spec's prompts (token ids, optional
``cache_salt``), and writes per request the output tokens, vLLM's ``num_cached_tokens``, the
prompt tokens the model really ran through its embedding (a forward hook), its wall time and
the process's CPU time over it (and that of kvtier's own threads), and the connector's
counters. A step with ``beside`` adds its prompt while another request decodes
(``_run_beside``). Actions between steps: kill a
process (Redis), or wait for the connector's queued saves and IO (``drain_connector``:
seconds). Run as a script only: vLLM changes torch's thread count in the process that hosts it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# The embedding counter is sent to the worker processes as a function (``embed_counter``).
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

import embed_counter  # beside this script; run_scenario also puts it on the workers' path


def _llm(spec: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if spec.get("connector") == "noop":
        transfer = KVTransferConfig(kv_connector="NoopConnector",
                                    kv_connector_module_path="noop_connector", kv_role="kv_both")
    elif spec.get("connector") is not None:
        transfer = KVTransferConfig(kv_connector="KvtierConnector",
                                    kv_connector_module_path="kvtier.integrations.vllm",
                                    kv_role="kv_both",
                                    kv_connector_extra_config=spec["connector"])
    return LLM(model=spec["model"], dtype="float32", max_model_len=spec.get("max_model_len", 2048),
               enforce_eager=True, kv_transfer_config=transfer, seed=0,
               block_size=spec.get("block_size", 128),
               enable_prefix_caching=spec.get("prefix_caching", True),
               kv_cache_memory_bytes=spec.get("kv_cache_memory_bytes", 256 << 20),
               tensor_parallel_size=spec.get("tensor_parallel_size", 1),
               disable_log_stats=False)


class _Counter:
    """Counts the tokens the model's embedding sees (what vLLM really computed), in the process
    that runs the model: rank 0's count when vLLM's workers run in processes of their own."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        llm.apply_model(embed_counter.install)

    @property
    def tokens(self) -> int:
        return int(self.llm.apply_model(embed_counter.read)[0])


def _connector_stats() -> dict[str, Any]:
    try:
        from kvtier.integrations.vllm.runtime import runtimes
    except ImportError:
        return {}
    found = runtimes()
    return found[0].stats()["connector"] if found else {}


def _kvtier_thread_cpu() -> float:
    """CPU seconds so far of this process's live threads named ``kvtier-*`` (the saver, the IO
    workers): what kvtier's background work cost, whatever else ran meanwhile."""
    import threading

    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for thread in threading.enumerate():
        if not thread.name.startswith("kvtier-") or thread.native_id is None:
            continue
        try:
            stat = Path(f"/proc/self/task/{thread.native_id}/stat").read_text()
        except OSError:             # it ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        total += (int(fields[11]) + int(fields[12])) / ticks     # utime + stime
    return total


def _run_step(llm: Any, counter: _Counter, step: dict[str, Any]) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    sampling = {"max_tokens": step.get("max_tokens", 8), "temperature": 0.0, "ignore_eos": True}
    results = []
    for prompt in step["prompts"]:
        extra = {"kv_transfer_params": {"kvtier_cache": False}} if prompt.get("kvtier_off") else None
        params = SamplingParams(**sampling, extra_args=extra)
        request: dict[str, Any] = {"prompt_token_ids": prompt["tokens"]}
        if prompt.get("salt"):
            request["cache_salt"] = prompt["salt"]
        before, kvtier_cpu = counter.tokens, _kvtier_thread_cpu()
        started, cpu = time.perf_counter(), _cpu_seconds()
        out = llm.generate([request], params, use_tqdm=False)[0]
        results.append({"tokens": list(out.outputs[0].token_ids),
                        "num_cached_tokens": out.num_cached_tokens or 0,
                        "computed_tokens": counter.tokens - before,
                        "kvtier_off": bool(prompt.get("kvtier_off")),
                        "seconds": time.perf_counter() - started,
                        "cpu_seconds": _cpu_seconds() - cpu,
                        "kvtier_thread_cpu_seconds": _kvtier_thread_cpu() - kvtier_cpu})
    return results


def _run_beside(llm: Any, counter: _Counter, step: dict[str, Any]) -> list[dict[str, Any]]:
    """``{"beside": {"tokens": [...], "max_tokens": N, "after": K}, "prompts": [P]}``: start
    the ``beside`` request, step the engine until it generated ``K`` tokens, then add ``P``
    and step until both finish (``P`` arrives while another request runs). Returns ``P``'s
    result then the ``beside`` request's, each with the longest wall-clock gap between two of
    its tokens (and ``P``'s time to its first token)."""
    from vllm import SamplingParams

    engine, beside = llm.llm_engine, step["beside"]
    (prompt,) = step["prompts"]
    sampling = {"temperature": 0.0, "ignore_eos": True}
    engine.add_request("beside", {"prompt_token_ids": beside["tokens"]},
                       SamplingParams(max_tokens=beside["max_tokens"], **sampling))
    seen: dict[str, list[float]] = {"beside": [], "prompt": []}
    done: dict[str, Any] = {}
    added = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            seen[out.request_id].extend([now] * (len(out.outputs[0].token_ids)
                                                 - len(seen[out.request_id])))
            if out.finished:
                done[out.request_id] = out
        if added is None and len(seen["beside"]) >= beside["after"]:
            added = time.perf_counter()
            engine.add_request("prompt", {"prompt_token_ids": prompt["tokens"]},
                               SamplingParams(max_tokens=step.get("max_tokens", 8), **sampling))
    results = []
    for name in ("prompt", "beside"):
        times = seen[name]
        results.append({"tokens": list(done[name].outputs[0].token_ids),
                        "num_cached_tokens": done[name].num_cached_tokens or 0,
                        "first_token_s": times[0] - added if name == "prompt" else None,
                        "max_gap_s": max((b - a for a, b in zip(times, times[1:],
                                                                strict=False)), default=0.0)})
    return results


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    started = time.perf_counter()
    llm = _llm(spec)
    counter = _Counter(llm)
    out: dict[str, Any] = {"load_seconds": time.perf_counter() - started, "steps": []}
    out["actions"] = []
    for step in spec["steps"]:
        if step.get("action"):
            out["actions"].append(_act(step["action"]))
            continue
        run = _run_beside if step.get("beside") else _run_step
        out["steps"].append(run(llm, counter, step))
    out["connector"] = _connector_stats()
    Path(out_path).write_text(json.dumps(out))


def _cpu_seconds() -> float:
    """CPU time of this process so far, every thread (user + system)."""
    times = os.times()
    return times.user + times.system


def _act(action: dict[str, Any]) -> dict[str, Any]:
    """Side effects between steps: stop the Redis server the remote tier uses, or wait for the
    connector's background work; returns what it measured."""
    started, cpu, kvtier_cpu = time.perf_counter(), _cpu_seconds(), _kvtier_thread_cpu()
    done = True
    if action.get("kill_pid"):
        os.kill(int(action["kill_pid"]), 9)
        time.sleep(0.2)
    if action.get("drain_connector"):
        from kvtier.integrations.vllm.runtime import runtimes

        done = all(r.drain(float(action["drain_connector"])) for r in runtimes())
    return {"done": done, "seconds": time.perf_counter() - started,
            "cpu_seconds": _cpu_seconds() - cpu,
            "kvtier_thread_cpu_seconds": _kvtier_thread_cpu() - kvtier_cpu}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
