"""Fixtures for the services' unit tests: a real Redis (the local one, or a private redis-server) and a key
prefix per test, so tests never see each other's streams (defined in tests/support/services.py, shared with the
batch unit tests)."""

from __future__ import annotations

from tests.support.services import prefix, redis_url, tokenizer

__all__ = ["prefix", "redis_url", "tokenizer"]
