# Prometheus from Debian's prometheus package (2.42), built locally: the container smoke test
# (scripts/compose_smoke.py) runs it in place of the official prom/prometheus image, which it cannot
# pull. Made to behave like that image where docker-compose.yml relies on it: the server as the
# entrypoint (the compose file passes only flags), `wget` for the healthcheck, a /prometheus data
# directory owned by nobody, the user it runs as. Not for production: docker-compose.yml names the
# official image.

ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# Apt versions unpinned on purpose: the base image tag pins the release, and Debian drops superseded
# package versions from its archive, so exact pins would break rebuilds after each security update.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends prometheus wget \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /prometheus /etc/prometheus \
    && chown 65534:65534 /prometheus
VOLUME /prometheus
WORKDIR /prometheus
USER 65534:65534
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
