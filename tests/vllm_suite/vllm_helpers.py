"""Helpers of the vLLM plug-in suite: a tiny random Llama on disk, prompts, scenario runs.

``build_model(dir)`` writes a 4-layer Llama (kvtier's embedded ``tiny-llama`` config and
tokenizer, seeded random weights) as a Hugging Face directory vLLM loads without a download.
``run_scenario(spec, tmp)`` runs ``scenario.py`` in a fresh Python process and returns what it
wrote. Runs inside ``.venv-vllm``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "src" / "kvtier" / "engine" / "assets"
SCENARIO = Path(__file__).with_name("scenario.py")
VOCAB_LOW, VOCAB_HIGH = 5, 1000        # ordinary tokens of the tiny tokenizer (no specials)


def build_model(directory: Path, seed: int = 0, **shape: Any) -> Path:
    """The tiny random-weight Llama as a model directory (idempotent); ``shape`` overrides
    config fields (``hidden_size``, ``num_hidden_layers``, ...) for a larger model."""
    if (directory / "model.safetensors").exists():
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**{**json.loads((ASSETS / "tiny-llama.json").read_text()), **shape})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / "tokenizer" / name, directory / name)
    return directory


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length)] for _ in range(count)]


def cpu_binding(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` CPU workers: this process's cores split into
    that many consecutive groups (vLLM's CPU backend refuses to guess without NUMA nodes)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise RuntimeError(f"{ranks} CPU ranks need {ranks} cores; this process has {len(cores)}")
    share = len(cores) // ranks
    return "|".join(",".join(map(str, cores[i * share:(i + 1) * share])) for i in range(ranks))


def run_scenario(spec: dict[str, Any], workdir: Path, timeout_s: float = 900) -> dict[str, Any]:
    """Run one vLLM engine process on ``spec`` (``spec["env"]``: variables set for it); raise
    with its output tail if it fails."""
    workdir.mkdir(parents=True, exist_ok=True)
    index = len(list(workdir.glob("spec-*.json")))
    spec_path, out_path = workdir / f"spec-{index}.json", workdir / f"out-{index}.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(SCENARIO.parent)])
    if spec.get("tensor_parallel_size", 1) > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(spec["tensor_parallel_size"])
    env.update(spec.get("env", {}))
    run = subprocess.run([sys.executable, str(SCENARIO), str(spec_path), str(out_path)],
                         capture_output=True, text=True, timeout=timeout_s, env=env,
                         stdin=subprocess.DEVNULL)
    if run.returncode != 0 or not out_path.exists():
        tail = "\n".join((run.stdout + run.stderr).strip().splitlines()[-60:])
        raise AssertionError(f"vLLM scenario failed (rc {run.returncode}):\n{tail}")
    return json.loads(out_path.read_text())
