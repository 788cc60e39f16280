# Load generator: Locust (UI on 8089, or headless) and `python -m kernellab.bench.serve`.
# Built from the repository root: docker build -f images/loadgen.Dockerfile .
# Same CUDA base, Python and build arguments (BASE_IMAGE, PYTHON) as the other images (see
# gateway.Dockerfile); no torch.

ARG BASE_IMAGE=nvidia/cuda:13.0.2-base-ubuntu24.04
ARG PYTHON=python3.12

FROM ${BASE_IMAGE} AS build
ARG PYTHON
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
COPY pyproject.toml README.md ./
COPY images/requirements_from_pyproject.py images/
RUN --mount=type=secret,id=pip_cert --mount=type=bind,source=images/wheels,target=/wheels \
    python images/requirements_from_pyproject.py pyproject.toml \
        --dep locust --dep matplotlib --dep httpx --dep numpy > /tmp/requirements.txt \
    && kl-pip-install --requirement /tmp/requirements.txt
COPY kernellab kernellab
COPY kernels kernels
COPY runtime runtime
COPY services services
RUN --mount=type=secret,id=pip_cert --mount=type=bind,source=images/wheels,target=/wheels \
    kl-pip-install --no-deps /src

FROM ${BASE_IMAGE}
ARG PYTHON
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH \
    LOCUST_LOCUSTFILE=/home/kernellab/locustfile.py MPLBACKEND=Agg
# Apt versions unpinned on purpose (DL3008): see the build stage of gateway.Dockerfile.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends "${PYTHON}" ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 kernellab \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/kernellab kernellab
COPY --from=build /opt/venv /opt/venv
COPY images/healthcheck.py /usr/local/bin/kl-healthcheck
COPY --chown=kernellab:kernellab services/loadgen/locustfile.py /home/kernellab/locustfile.py
USER 10001:10001
WORKDIR /home/kernellab
EXPOSE 8089
# Probes the Locust web UI; a headless run (`locust --headless ...`) is a batch job, run it with
# `docker run --no-healthcheck`.
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["kl-healthcheck", "http://127.0.0.1:8089/"]
CMD ["locust", "--web-host", "0.0.0.0"]
