#!/usr/bin/env bash
# Builds .anchors/venv: an isolated venv holding the anchors kvtier's disk tier is compared
# with (SGLang 0.5.23's HiCacheFile, LMCache 0.5.6's LocalDiskBackend), CPU-only, so that their
# pins never touch kvtier's own venv. Both are installed without their dependency lists (which
# pin CUDA builds), then with the small set of modules their storage code imports.
# Idempotent. Used by benchmarks/store/compare_disk_anchors.py.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.anchors/venv
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
NUMPY_PIN="numpy<=2.2.6"  # LMCache 0.5.6 needs it; repeated on every install so nothing moves it
"${PIP[@]}" "$NUMPY_PIN" "torch==2.13.0"
"${PIP[@]}" --no-deps "sglang==0.5.23" "lmcache==0.5.6"
"${PIP[@]}" "$NUMPY_PIN" "torch==2.13.0" \
    orjson psutil pybase64 requests triton packaging pillow starlette msgspec pydantic pyzmq \
    tqdm ipython aiohttp pyyaml cachetools sortedcontainers numba prometheus_client \
    py-cpuinfo aiofile transformers cryptography xxhash msgpack
"$VENV/bin/python" - <<'PY'
from sglang.srt.mem_cache.hicache_storage import HiCacheFile  # noqa: F401
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend  # noqa: F401
import numpy
print(f"anchors ready: sglang HiCacheFile and lmcache LocalDiskBackend import (numpy {numpy.__version__})")
PY
