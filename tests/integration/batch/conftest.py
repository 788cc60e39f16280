"""Fixtures of the batch integration tests: the batch stack (see tests.support.batch) on the private Redis."""

from __future__ import annotations

import pytest

from tests.support.batch import BatchStack


@pytest.fixture(scope="package")
def batch_stack(private_redis, tmp_path_factory):
    s = BatchStack(private_redis.url, tmp_path_factory.mktemp("batch-stack")).start()
    yield s
    s.stop()


@pytest.fixture(scope="package")
def client(batch_stack):
    return batch_stack.openai()
