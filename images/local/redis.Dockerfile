# Redis from Debian's redis-server package, built locally: the container smoke test
# (scripts/compose_smoke.py) runs it in place of the official redis image, which it cannot pull.
# Made to behave like that image where docker-compose.yml relies on it: `sh` and `redis-cli` on the
# PATH, a /data directory that the service's user (999:1000) can write, no entrypoint of its own.
# Not for production: docker-compose.yml names the official image.

ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# Apt versions unpinned on purpose: the base image tag pins the release, and Debian drops superseded
# package versions from its archive, so exact pins would break rebuilds after each security update.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data \
    && chown 999:1000 /data
VOLUME /data
WORKDIR /data
USER 999:1000
EXPOSE 6379
CMD ["redis-server", "--protected-mode", "no"]
