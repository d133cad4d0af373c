# kvtier serve: the OpenAI-compatible server on the reference engine with the tiered KV cache.
#
#   docker build -t kvtier .                                  # CPU image (default)
#   docker build -t kvtier:cuda --build-arg VARIANT=cuda .    # CUDA image (PyTorch's CUDA wheels)
#   docker run -p 8000:8000 -v kvtier-data:/data kvtier       # disk tier under the /data volume
#   docker run -e KVTIER_STORE__DISK_URL= kvtier --no-cache   # the baseline: no tier at all
#   docker run --gpus all -p 8000:8000 kvtier:cuda --model /models/my-llama
#
# Every setting also comes from KVTIER_<SECTION>__<FIELD> variables (see `kvtier info --help`).
ARG VARIANT=cpu
ARG PYTHON_VERSION=3.12
ARG CUDA_BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---- CPU runtime: slim Python, PyTorch's CPU wheels --------------------------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime-cpu
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
    VIRTUAL_ENV=/opt/kvtier
RUN python -m venv "$VIRTUAL_ENV"

# ---- CUDA runtime: NVIDIA's base image, the distribution's Python, PyTorch's default wheels -----
FROM ${CUDA_BASE} AS runtime-cuda
ENV TORCH_INDEX_URL="" \
    VIRTUAL_ENV=/opt/kvtier \
    DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV"

# ---- the image ------------------------------------------------------------------------------
# hadolint ignore=DL3006
FROM runtime-${VARIANT} AS final
ARG TORCH_VERSION=2.13.0
ENV PATH="/opt/kvtier/bin:$PATH" \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVTIER_SERVER__HOST=0.0.0.0 \
    KVTIER_SERVER__PORT=8000 \
    KVTIER_STORE__DISK_URL=file:///data/disk
WORKDIR /src
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX_URL"; \
    else \
        pip install "torch==${TORCH_VERSION}"; \
    fi
COPY pyproject.toml README.md ./
COPY src ./src
# The project itself installs from the copied source; its dependencies are bounded in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install ".[serve]" "torch==${TORCH_VERSION}" \
    && useradd --system --create-home --home-dir /home/kvtier --uid 10001 kvtier \
    && mkdir -p /data \
    && chown kvtier /data
USER 10001
WORKDIR /home/kvtier
VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["kvtier", "serve"]
CMD []
