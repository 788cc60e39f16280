"""Helpers shared by the tests, imported as ``tests.support.<module>`` (pytest puts the repository root on
``sys.path`` because ``tests`` is a package; processes the tests start get it through ``PYTHONPATH``).

- ``fake_engine``: a deterministic stand-in for ``LLMEngine`` (services and batch unit tests; workers started
  as processes load it with ``KERNELLAB_ENGINE=tests.support.fake_engine:FakeEngine``).
- ``services``: the real-Redis, key-prefix and tokenizer fixtures of the services and batch unit tests.
- ``stack``: a private redis-server and the stack (gateway + workers) as real processes, metrics, waits (the
  processes themselves through ``kernellab.services.processes``, as ``kernellab up`` and the benchmarks).
- ``benchmarks``: a benchmark script run small on this CPU, its artifact validated.
- ``batch``: the Batch API stack (the stack plus a Celery batch worker) and its request helpers.
- ``reliability``: the reliability tests' API keys and OpenAI-error checks.
- ``gateway_openapi``: the gateway's OpenAPI document completed for fuzzing.
- ``deploy``: binaries the CI installs, a real Prometheus server, the Grafana dashboards' queries.
- ``kernels``: per-dtype tolerances, NaN-poisoned outputs and a verbose comparison for the kernel tests (CPU
  interpreter and GPU).
"""
