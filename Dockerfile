# syntax=docker/dockerfile:1.7
# specdraft GPU image: the Prefect process worker, the Ray head/worker nodes (cluster launcher
# and KubeRay) and `specdraft ...` one-off runs all use it.  See infra/README.md.
#
#   docker build -t specdraft:0.1.0 .                              # with flash-attn (built here)
#   docker build -t specdraft:0.1.0 --build-arg WITH_FLASH_ATTN=0 .   # quick: no flash-attn
#   docker build -t specdraft:0.1.0 --build-arg FLASH_ATTN_WHEEL=https://.../flash_attn-...whl .
#
# torch==2.13.0 from PyPI is the CUDA 13.0 build (it pulls cuda-toolkit 13.0.x, cuDNN and NCCL
# as wheels), so the base images are CUDA 13.0 and the host needs an NVIDIA driver >= 580.
# Python 3.11: constraints.txt was verified on 3.11 (some pins, e.g. orjson 3.8.3, have no
# 3.12 wheels), so the interpreter is a python-build-standalone 3.11 installed with uv.

ARG CUDA_VERSION=13.0.1
ARG UBUNTU_VERSION=24.04
ARG UV_VERSION=0.13.8

FROM ghcr.io/astral-sh/uv:${UV_VERSION} AS uv

# ---------------------------------------------------------------------------------------------
# builder: devel image (nvcc, headers) so flash-attn can be compiled against the installed torch
# ---------------------------------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS builder
ARG PYTHON_VERSION=3.11
# 1: install the `gpu` extra (flash-attn); 0: skip it (no compile, image builds in minutes)
ARG WITH_FLASH_ATTN=1
ARG FLASH_ATTN_VERSION=2.8.3.post2
# URL of a prebuilt wheel matching torch 2.13 / cu13 / cp311: no compile
ARG FLASH_ATTN_WHEEL=
# compile only for these SMs: 80 = Ampere/Ada (A100, A10G, L4, L40S), 90 = Hopper (H100/H200);
# add 100/120 for Blackwell (each arch roughly doubles build time and memory)
ARG FLASH_ATTN_CUDA_ARCHS="80;90"
ARG MAX_JOBS=4

ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates git build-essential \
    && rm -rf /var/lib/apt/lists/*

COPY --from=uv /uv /usr/local/bin/uv
ENV UV_PYTHON_INSTALL_DIR=/opt/python UV_PYTHON_PREFERENCE=only-managed
RUN uv python install "${PYTHON_VERSION}" \
    && uv venv --seed --python "${PYTHON_VERSION}" /opt/venv
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /opt/specdraft
COPY constraints.txt ./

# README set-up, step 1 (its own layer: the largest and the most stable one).
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install torch==2.13.0

# flash-attn (the `gpu` extra) ships no wheels on PyPI and must be built against the torch
# above, without build isolation; installing it first means step 2 below finds it satisfied.
RUN --mount=type=cache,target=/root/.cache/pip \
    if [ "$WITH_FLASH_ATTN" = "1" ]; then \
        pip install -c constraints.txt packaging psutil ninja wheel \
        && if [ -n "$FLASH_ATTN_WHEEL" ]; then \
            pip install -c constraints.txt "$FLASH_ATTN_WHEEL"; \
        else \
            FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS="$FLASH_ATTN_CUDA_ARCHS" \
            MAX_JOBS="$MAX_JOBS" NVCC_THREADS=2 \
            pip install -c constraints.txt --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}"; \
        fi; \
    fi

COPY pyproject.toml README.md prefect.yaml ./
COPY specdraft ./specdraft
COPY pipelines ./pipelines
COPY flows ./flows
COPY configs ./configs

# README set-up, step 2, with the `gpu` extra instead of `dev` (no test tooling in the image).
RUN --mount=type=cache,target=/root/.cache/pip \
    if [ "$WITH_FLASH_ATTN" = "1" ]; then \
        pip install -c constraints.txt -e ".[gpu]"; \
    else \
        pip install -c constraints.txt -e "."; \
    fi

# What a Ray *cluster* node needs beyond the library: ray[default] (dashboard, job submission,
# Ray Client on :10001, KubeRay probes/autoscaler), boto3 (AWS cluster launcher), s3fs (s3://
# feature stores).  Pinned in infra/docker/requirements-cluster.txt, resolved against constraints.txt.
COPY infra/docker/requirements-cluster.txt /tmp/requirements-cluster.txt
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -c constraints.txt -r /tmp/requirements-cluster.txt \
    && python -m compileall -q specdraft pipelines flows

# ---------------------------------------------------------------------------------------------
# runtime: CUDA runtime base (torch brings its own cuDNN/NCCL/cuBLAS wheels), non-root user
# ---------------------------------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS runtime
ARG USER_UID=1000
ARG USER_GID=1000

ENV DEBIAN_FRONTEND=noninteractive
# wget: KubeRay health probes; openssh-client + rsync: Ray cluster launcher (head -> workers)
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates git wget openssh-client rsync \
    && rm -rf /var/lib/apt/lists/* \
    && (userdel --remove ubuntu 2>/dev/null || true) && (groupdel ubuntu 2>/dev/null || true) \
    && groupadd --gid "${USER_GID}" specdraft \
    && useradd --create-home --shell /bin/bash --uid "${USER_UID}" --gid "${USER_GID}" specdraft

COPY --from=builder /opt/python /opt/python
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /opt/specdraft /opt/specdraft

# Sources and the venv stay root-owned (read-only to the app); the working directory, run
# outputs and caches belong to the user.  Login shells (KubeRay starts Ray with `bash -lc`)
# may reset PATH from /etc/profile, so /etc/profile.d puts the venv back on it.
RUN install -d -o specdraft -g specdraft /opt/specdraft/runs \
        /home/specdraft/.cache /home/specdraft/.cache/huggingface \
    && chown specdraft:specdraft /opt/specdraft \
    && echo 'export PATH=/opt/venv/bin:$PATH VIRTUAL_ENV=/opt/venv' > /etc/profile.d/specdraft-venv.sh

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    SPECDRAFT_HOME=/opt/specdraft \
    HF_HOME=/home/specdraft/.cache/huggingface \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    RAY_USAGE_STATS_ENABLED=0 \
    DO_NOT_TRACK=1

USER specdraft
WORKDIR /opt/specdraft
ENTRYPOINT ["specdraft"]
CMD ["--help"]
