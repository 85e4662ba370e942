# syntax=docker/dockerfile:1.7
# The training image: CUDA, torch, DeepSpeed with its async I/O (libaio) and CPU Adam
# ops compiled ahead of time, and the runtime package. Also runs the node probe.
#
#   docker build -f docker/runtime.Dockerfile -t ghcr.io/spillway/runtime:0.1.0 .
#
# The builder stage has nvcc and headers to compile DeepSpeed's ops; the final stage
# only the CUDA runtime, cuDNN and libaio. Pin the bases by digest in CI.
#
# The CPU flavour (the test cluster's real node, `hack/images build runtime-cpu`) is
# this same file with other bases and DS_ACCELERATOR=cpu:
#   --build-arg BUILD_IMAGE=<Debian + python3> --build-arg BASE_IMAGE=<Debian + python3>
#   --build-arg AIO_PACKAGE=libaio1 --build-arg DS_ACCELERATOR=cpu
#   --build-arg TORCH_INDEX=https://pypi.org/simple

ARG CUDA_VERSION=12.8.1
ARG UBUNTU=ubuntu24.04
ARG BUILD_IMAGE=nvidia/cuda:${CUDA_VERSION}-cudnn-devel-${UBUNTU}
ARG BASE_IMAGE=nvidia/cuda:${CUDA_VERSION}-cudnn-runtime-${UBUNTU}
# Where torch comes from: PyPI's wheel index for the CUDA minor above.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
# Compute capabilities the ops are compiled for: V100, A100, A10/RTX 30, L40S/RTX 40, H100.
ARG TORCH_CUDA_ARCH_LIST="7.0;8.0;8.6;8.9;9.0"
# DeepSpeed's accelerator the ops are built for. Named, not detected: the build host
# usually has no GPU, and DeepSpeed would then build the CPU ops. At run time DeepSpeed
# detects it (CUDA where a GPU is visible, else the CPU).
ARG DS_ACCELERATOR=cuda
# The libaio runtime package of the final base (Ubuntu 24.04: libaio1t64; Debian 12: libaio1).
ARG AIO_PACKAGE=libaio1t64

# ---- build ------------------------------------------------------------------------
FROM ${BUILD_IMAGE} AS build
ARG TORCH_INDEX
ARG TORCH_CUDA_ARCH_LIST
ARG DS_ACCELERATOR
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install --yes --no-install-recommends \
      python3 python3-venv python3-dev build-essential ninja-build libaio-dev git \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
RUN python3 -m venv /opt/spillway
ENV PATH=/opt/spillway/bin:$PATH
# Dependencies first, code last, so that a code change rebuilds no dependency layer.
# The slow layer (torch, DeepSpeed and its compiled ops) is made from docker/deepspeed.lock
# alone, requirements.lock's pins of those packages and what they need: another
# dependency's change rebuilds only the quick layer after it.
# torch first, from TORCH_INDEX, at the version the lock pins; or, where the build mounts
# them at WHEELS (hack/images: the wheels hack/setup.sh made for this machine's own
# environment, DeepSpeed's CPU ops already compiled in), from those wheels alone.
# DeepSpeed's ops are compiled now, so pods never JIT-compile at start (the final image has
# no compiler): async_io, cpu_adam, fused_adam, pin_memory, and on the CPU accelerator the
# shared-memory collectives that init_distributed loads (shm_comm).
# LDFLAGS: DeepSpeed's ahead-of-time build of the CPU accelerator's ops drops their link
# flags (its JIT build keeps them), so async_io would miss libaio's io_submit at import;
# the ops are then loaded here, as a pod would, so such a miss fails the build.
ARG WHEELS=
COPY docker/deepspeed.lock ./
RUN export DS_ACCELERATOR="${DS_ACCELERATOR}" \
 && if [ -n "${WHEELS}" ]; then \
      pip install --no-index --find-links "${WHEELS}" -r deepspeed.lock setuptools==84.2.1; \
    else \
      pip install --index-url "${TORCH_INDEX}" "$(grep '^torch==' deepspeed.lock)" \
      && pip install --constraint deepspeed.lock setuptools==84.2.1 wheel==0.45.1 ninja py-cpuinfo packaging numpy \
      && export LDFLAGS="-Wl,--no-as-needed -laio" \
      && DS_BUILD_AIO=1 DS_BUILD_CPU_ADAM=1 DS_BUILD_UTILS=1 DS_BUILD_PIN_MEMORY=1 DS_BUILD_FUSED_ADAM=1 DS_BUILD_SHM_COMM=1 \
         TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" \
         pip install --constraint deepspeed.lock --no-build-isolation "$(grep '^deepspeed==' deepspeed.lock)"; \
    fi \
 && python -c "import deepspeed.ops.op_builder as b; assert b.AsyncIOBuilder().is_compatible(), 'libaio missing'" \
 && python -c "from deepspeed.git_version_info import installed_ops as i; \
want = ['async_io', 'cpu_adam', 'fused_adam'] + (['deepspeed_shm_comm'] if '${DS_ACCELERATOR}' == 'cpu' else []); \
missing = [op for op in want if not i.get(op)]; assert not missing, f'ops not compiled: {missing}'" \
 && python -c "from deepspeed.accelerator import get_accelerator; \
[get_accelerator().create_op_builder(name).load() for name in ('AsyncIOBuilder', 'CPUAdamBuilder', 'FusedAdamBuilder')]"
# The project's own dependencies and those of its `runtime` and `operator` extras (the
# kubernetes client the runtime uses for status and the node probe for annotations), at
# the pinned versions; torch and DeepSpeed are already there at theirs, so pip keeps them.
COPY requirements.lock pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['runtime'] + p['optional-dependencies']['operator']))" \
      > runtime-requirements.txt \
 && pip install --constraint requirements.lock -r runtime-requirements.txt \
 && python -c "import deepspeed, torch; from deepspeed.git_version_info import installed_ops as i; \
assert i.get('async_io') and i.get('cpu_adam'), 'DeepSpeed was reinstalled without its ops'" \
 && pip uninstall --yes pip setuptools wheel \
 && python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > /opt/spillway/site-packages-dir

# ---- final ------------------------------------------------------------------------
FROM ${BASE_IMAGE}
ARG AIO_PACKAGE
LABEL org.opencontainers.image.title="spillway-runtime" \
      org.opencontainers.image.description="Spillway training runtime: CUDA, torch, DeepSpeed ZeRO-Offload/Infinity" \
      org.opencontainers.image.source="https://github.com/spillway/spillway" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV DEBIAN_FRONTEND=noninteractive
# libaio: DeepSpeed's NVMe swapper (ZeRO-Infinity) reads and writes through it.
RUN apt-get update \
 && apt-get install --yes --no-install-recommends python3 "${AIO_PACKAGE}" \
 && rm -rf /var/lib/apt/lists/* \
 && (userdel --remove ubuntu 2>/dev/null || true) \
 && groupadd --gid 1000 spillway \
 && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/spillway --shell /usr/sbin/nologin spillway
COPY --from=build /opt/spillway /opt/spillway
# The runtime package itself, last and small: found through a .pth file.
COPY runtime/spillway_runtime/ /opt/spillway/src/spillway_runtime/
RUN echo /opt/spillway/src > "$(cat /opt/spillway/site-packages-dir)/spillway.pth"
ENV PATH=/opt/spillway/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/spillway \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /home/spillway
USER 1000:1000
ENTRYPOINT ["python3", "-m", "spillway_runtime"]
