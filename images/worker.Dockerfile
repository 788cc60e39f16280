# GPU worker (`kernellab worker`), also the RunPod serverless worker (runpod/handler.py).
# Built from the repository root: docker build -f images/worker.Dockerfile .
#
# torch: PyPI's Linux x86_64 wheel of torch 2.11.0 is the CUDA 13.0 build (it depends on the
# nvidia-*-cu13 wheels), the build measured on the H200; the base image's CUDA 13.0.2 and cuDNN match.
# The host driver must support CUDA 13.0 (R580 or newer).
#
# Build arguments (the defaults build the GPU image; BASE_IMAGE, PYTHON, EXTRA_PIP as in gateway.Dockerfile):
#   TORCH_VERSION    the torch release
#   TORCH_INDEX_URL  empty: PyPI (CUDA build); the compose `cpu` profile uses PyTorch's CPU index,
#                    https://download.pytorch.org/whl/cpu (a ~200 MB wheel instead of several GB)
#   TRITON           the pyproject extra that brings Triton, which runs our kernels on the GPU. Empty for
#                    the `cpu` profile: a CPU worker runs the torch reference ops, and Triton (~1 GB
#                    installed) and the compiler it needs at run time would be dead weight

ARG BASE_IMAGE=nvidia/cuda:13.0.2-cudnn-runtime-ubuntu24.04
ARG PYTHON=python3.12
ARG TORCH_VERSION=2.11.0
ARG TRITON=triton

FROM ${BASE_IMAGE} AS build
ARG PYTHON
ARG TORCH_VERSION
ARG TORCH_INDEX_URL=""
ARG TRITON
ARG EXTRA_PIP=""
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Apt versions unpinned on purpose: see gateway.Dockerfile.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends "${PYTHON}" "${PYTHON}-venv" \
    && rm -rf /var/lib/apt/lists/*
RUN "${PYTHON}" -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY images/pip-install.sh /usr/local/bin/kl-pip-install
WORKDIR /src
# torch alone first: the largest layer, rebuilt only when TORCH_VERSION or its index changes.
RUN --mount=type=secret,id=pip_cert --mount=type=bind,source=images/wheels,target=/wheels \
    kl-pip-install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md ./
COPY images/requirements_from_pyproject.py images/
# The constraint keeps every later install from replacing the build of torch installed above.
RUN --mount=type=secret,id=pip_cert --mount=type=bind,source=images/wheels,target=/wheels \
    echo "torch==${TORCH_VERSION}" > /tmp/constraints.txt \
    && python images/requirements_from_pyproject.py pyproject.toml --all-core \
        --dep runpod ${TRITON:+--dep "$TRITON"} > /tmp/requirements.txt \
    && kl-pip-install --constraint /tmp/constraints.txt --requirement /tmp/requirements.txt
# EXTRA_PIP is a list of requirements: word splitting is intended.
# hadolint ignore=SC2086
RUN --mount=type=secret,id=pip_cert --mount=type=bind,source=images/wheels,target=/wheels \
    if [ -n "${EXTRA_PIP}" ]; then kl-pip-install --no-deps ${EXTRA_PIP}; fi
COPY kernellab kernellab
COPY kernels kernels
COPY runtime runtime
COPY services services
RUN --mount=type=secret,id=pip_cert --mount=type=bind,source=images/wheels,target=/wheels \
    kl-pip-install --no-deps /src

FROM ${BASE_IMAGE}
ARG PYTHON
ARG TRITON
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH \
    HF_HOME=/var/cache/kernellab/hf TRITON_CACHE_DIR=/var/cache/kernellab/triton \
    KERNELLAB_MODEL=Qwen/Qwen3-0.6B KERNELLAB_DEVICE=cuda KERNELLAB_METRICS_HOST=0.0.0.0 \
    KERNELLAB_WORKER_METRICS_PORT=9200 \
    KERNELLAB_GPU_LOCK_DIR=/var/lib/kernellab/gpu-locks
# gcc and the Python headers (with Triton only): Triton compiles its small C launcher for each kernel at
# run time. util-linux gives flock, with which each compose replica claims its own GPU (worker-entrypoint.sh).
# Apt versions unpinned on purpose (DL3008): see the build stage of gateway.Dockerfile.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends "${PYTHON}" ${TRITON:+"${PYTHON}-dev" gcc libc6-dev} \
        util-linux ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 kernellab \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/kernellab kernellab \
    && mkdir -p /var/cache/kernellab/hf /var/cache/kernellab/triton /var/lib/kernellab/gpu-locks \
    && chown -R kernellab:kernellab /var/cache/kernellab /var/lib/kernellab
COPY --from=build /opt/venv /opt/venv
COPY images/healthcheck.py /usr/local/bin/kl-healthcheck
COPY images/worker-entrypoint.sh /usr/local/bin/kl-worker-entrypoint
COPY runpod/ /opt/kernellab/runpod/
USER 10001:10001
WORKDIR /home/kernellab
EXPOSE 9200
# kl-healthcheck expands the ${...} itself: the port comes from the container's environment.
HEALTHCHECK --interval=15s --timeout=5s --start-period=900s --retries=3 \
    CMD ["kl-healthcheck", "http://127.0.0.1:${KERNELLAB_WORKER_METRICS_PORT}/health"]
ENTRYPOINT ["kl-worker-entrypoint"]
CMD ["kernellab", "worker"]
