# syntax=docker/dockerfile:1.7
# The training image: CUDA, torch, DeepSpeed with its async I/O (libaio) and CPU Adam
# ops compiled ahead of time, and the runtime package. Also runs the node probe.
#
#   docker build -f docker/runtime.Dockerfile -t ghcr.io/spillway/runtime:0.1.0 .
#
# The builder stage has nvcc and headers to compile DeepSpeed's ops; the final stage
# only the CUDA runtime, cuDNN and libaio. Pin the bases by digest in CI.

ARG CUDA_VERSION=12.8.1
ARG UBUNTU=ubuntu24.04
# PyTorch's wheel index for the CUDA minor above.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
# Compute capabilities the ops are compiled for: V100, A100, A10/RTX 30, L40S/RTX 40, H100.
ARG TORCH_CUDA_ARCH_LIST="7.0;8.0;8.6;8.9;9.0"

# ---- build ------------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-cudnn-devel-${UBUNTU} AS build
ARG TORCH_INDEX
ARG TORCH_CUDA_ARCH_LIST
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install --yes --no-install-recommends \
      python3 python3-venv python3-dev build-essential ninja-build libaio-dev git \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml requirements.lock README.md ./
COPY runtime/ runtime/
COPY operator/ operator/
COPY api/ api/
RUN python3 -m venv /opt/spillway
ENV PATH=/opt/spillway/bin:$PATH
# torch first, from the CUDA index, at the version requirements.lock pins.
RUN pip install --index-url "${TORCH_INDEX}" "$(grep '^torch==' requirements.lock)"
# DeepSpeed's async_io and cpu_adam ops built now, so pods never JIT-compile at start
# (the final image has no compiler). The `operator` extra brings the kubernetes client
# the runtime uses for status and the node probe for annotations.
RUN DS_BUILD_AIO=1 DS_BUILD_CPU_ADAM=1 DS_BUILD_UTILS=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" \
    pip install --constraint requirements.lock --no-build-isolation ".[runtime,operator]" \
 && python -c "import deepspeed.ops.op_builder as b; assert b.AsyncIOBuilder().is_compatible(), 'libaio missing'" \
 && pip uninstall --yes pip setuptools wheel

# ---- final ------------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-cudnn-runtime-${UBUNTU}
LABEL org.opencontainers.image.title="spillway-runtime" \
      org.opencontainers.image.description="Spillway training runtime: CUDA, torch, DeepSpeed ZeRO-Offload/Infinity" \
      org.opencontainers.image.source="https://github.com/spillway/spillway" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV DEBIAN_FRONTEND=noninteractive
# libaio1t64: DeepSpeed's NVMe swapper (ZeRO-Infinity) reads and writes through it.
RUN apt-get update \
 && apt-get install --yes --no-install-recommends python3 libaio1t64 \
 && rm -rf /var/lib/apt/lists/* \
 && (userdel --remove ubuntu 2>/dev/null || true) \
 && groupadd --gid 1000 spillway \
 && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/spillway --shell /usr/sbin/nologin spillway
COPY --from=build /opt/spillway /opt/spillway
ENV PATH=/opt/spillway/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/spillway \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /home/spillway
USER 1000:1000
ENTRYPOINT ["python3", "-m", "spillway_runtime"]
