# syntax=docker/dockerfile:1
# Gateway (`kernellab gateway`) and Celery batch worker (`kernellab batch-worker`): torch-free.
# Built from the repository root: docker build -f images/gateway.Dockerfile .
#
# All our images start from NVIDIA's CUDA images (the design card) on one OS and one Python, so the
# venv built in the first stage runs unchanged in the second. The gateway needs no CUDA; the `base`
# flavour adds only the CUDA runtime library to Ubuntu 24.04.

FROM nvidia/cuda:13.0.2-base-ubuntu24.04 AS build
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Apt versions are not pinned: the base image tag pins the release, and Ubuntu drops superseded
# package versions from its archive, so exact pins would break rebuilds after each security update.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3.12 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# Dependencies first (their layer survives source edits), versions read from pyproject.toml.
COPY pyproject.toml README.md ./
COPY images/requirements_from_pyproject.py images/
RUN python images/requirements_from_pyproject.py pyproject.toml --all-core \
        --exclude torch --exclude accelerate --dep celery > /tmp/requirements.txt \
    && pip install --requirement /tmp/requirements.txt
COPY kernellab kernellab
COPY kernels kernels
COPY runtime runtime
COPY services services
# Our own package from this source tree; its dependencies are already installed above.
RUN pip install --no-deps /src

FROM nvidia/cuda:13.0.2-base-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH \
    HF_HOME=/var/cache/kernellab/hf KERNELLAB_MODEL=Qwen/Qwen3-0.6B KERNELLAB_HOST=0.0.0.0 KERNELLAB_PORT=8000 \
    KERNELLAB_GATEWAY_METRICS_PORT=9100 KERNELLAB_METRICS_HOST=0.0.0.0 \
    KERNELLAB_FILES_DIR=/var/lib/kernellab/files
# Apt versions unpinned on purpose (DL3008): see the build stage of gateway.Dockerfile.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 kernellab \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/kernellab kernellab \
    && mkdir -p /var/cache/kernellab/hf /var/lib/kernellab/files \
    && chown -R kernellab:kernellab /var/cache/kernellab /var/lib/kernellab
COPY --from=build /opt/venv /opt/venv
COPY images/healthcheck.py /usr/local/bin/kl-healthcheck
USER 10001:10001
WORKDIR /home/kernellab
EXPOSE 8000 9100
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["kl-healthcheck", "http://127.0.0.1:8000/health"]
CMD ["kernellab", "gateway"]
