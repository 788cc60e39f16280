#!/usr/bin/env bash
# System packages the tests need (placeholder until the deployment checks land).
set -euo pipefail
command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server; }
