"""The Batch API (OpenAI's /v1/files + /v1/batches) on Celery, and ``kernellab batch`` offline: see docs/batch.md."""
