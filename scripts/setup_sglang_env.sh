#!/usr/bin/env bash
# Builds .venv-sglang/: an isolated environment where SGLang 0.5.23's HiCache storage interface and
# host pool classes import on a CPU-only machine, with kvtier installed editable beside them. The
# SGLang plug-in's tests (tests/sglang_suite) and its benchmark run there, so SGLang's pins never
# touch .venv.
#
# SGLang is installed with --no-deps (its full dependency set is a GPU serving stack); only the
# packages that its storage, host pool and config modules import are added, under the CPU build
# of torch 2.13.0. PyPI's torchvision wheel is a CUDA build whose operator library cannot load
# under CPU torch; SGLang's config package imports torchvision's Python transforms at import time,
# so the script installs the wheel without dependencies and a start-up hook that declares the two
# operator schemas torchvision registers fake kernels for (nms, qnms). The hook runs only when
# torchvision is imported; none of the storage code calls a torchvision operator.
#
# Idempotent: a stamp holding this script's and pyproject.toml's digests makes a second run a
# no-op. Usage: bash scripts/setup_sglang_env.sh [VENV_DIR]   (PYTHON=python3.11 to pick Python)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-sglang}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.installed"
TORCH_PIN="torch==2.13.0"
SGLANG_PIN="sglang==0.5.23"
TORCHVISION_PIN="torchvision==0.28.0"   # the release built against torch 2.13

# Modules that SGLang's hicache_storage, storage factory, pool_host and memory_pool import.
SGLANG_IMPORT_DEPS=(
  numpy triton orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic
  pyzmq tqdm ipython aiohttp dill gguf
  # pinned as SGLang 0.5.23 pins them
  "transformers==5.19.0" "apache-tvm-ffi==0.1.11" "compressed-tensors==0.18.0" "sentencepiece==0.2.1"
)
# kvtier's own runtime dependencies (pyproject [project.dependencies]), its redis extra, and the
# test runner for the suite.
KVTIER_DEPS=(xxhash pyyaml msgpack redis hiredis pytest pytest-timeout)

digest="$(cat "$0" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$digest" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi

echo "building $VENV (SGLang 0.5.23 on CPU torch 2.13.0)"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
pip_install() {
  # pip warns about every extra index folder lacking a package, and that SGLang's full (GPU)
  # dependency set is absent; only errors matter here.
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-compile "$@" 2>&1 \
    | { grep -v -e "^WARNING: Location" -e "^sglang 0.5.23 requires" \
          -e "dependency resolver does not currently" || true; }
  return "${PIPESTATUS[0]}"
}
pip_install --upgrade pip
# torch first and pinned in every later call, so no dependency can swap in a CUDA build.
pip_install "$TORCH_PIN"
pip_install --no-deps "$SGLANG_PIN" "$TORCHVISION_PIN"
pip_install "$TORCH_PIN" "${SGLANG_IMPORT_DEPS[@]}" "${KVTIER_DEPS[@]}"
pip_install --no-deps -e "$ROOT"

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cat > "$SITE/_kvtier_cpu_torchvision.py" <<'PY'
"""Lets the CUDA torchvision wheel import under CPU torch (installed by setup_sglang_env.sh).

torchvision registers fake kernels for ``torchvision::nms`` and ``qnms`` at import; those operators
come from its compiled library, which needs CUDA. Declaring the two schemas first lets the
pure-Python part of torchvision (the transforms SGLang's config modules import) load; calling
either operator still fails loudly.
"""

import importlib.abc
import sys


class _DeclareOpsFirst(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        if not hasattr(torch.ops.torchvision, "nms"):
            lib = torch.library.Library("torchvision", "DEF")
            lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _LIBRARIES.append(lib)
        return None


_LIBRARIES = []
sys.meta_path.insert(0, _DeclareOpsFirst())
PY
echo "import _kvtier_cpu_torchvision" > "$SITE/_kvtier_cpu_torchvision.pth"

# Fail the build here, not in the tests, if anything the plug-in needs does not import.
"$VENV/bin/python" -W ignore -c "
import sglang.srt.mem_cache.hicache_storage, sglang.srt.mem_cache.storage.backend_factory
import sglang.srt.mem_cache.pool_host.mha, sglang.srt.mem_cache.pool_host.mla, kvtier.store
"
echo "$digest" > "$STAMP"
echo "built $VENV"
