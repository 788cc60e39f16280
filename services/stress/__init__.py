"""``kernellab stress``: the real stack (Redis, gateway, workers with the embedded model) under a request mix,
faults and hostile clients, with a JSON artifact (schema ``kernellab.reliability/v1``).

- ``LocalStack``: a private redis-server, N workers and two gateways as real processes on 127.0.0.1 free
  ports. The second gateway shares the queue but stamps a short deadline (``KERNELLAB_REQUEST_TIMEOUT_S``):
  the API has no per-request deadline field, so requests meant to expire are sent there.
- ``run_scenario``: a closed-loop load (``concurrency`` clients, ``requests`` in all) plus, per scenario, a
  fault: ``worker-kill`` (kill -9, restart, repeated), ``worker-pause`` (SIGSTOP past the reclaim timeout,
  then SIGCONT), ``redis-restart`` (stopped, started empty), ``gateway-restart`` (SIGTERM drain, new process),
  ``slow-client`` (raw sockets that read their streams slowly), ``vanishing-client`` (many streams, then
  every socket reset). Then it waits until the stack is idle and reads each worker's KV blocks.

Every attempt ends as exactly one of: ``completed``; ``cancelled`` (the client closed it on purpose);
``error`` (a clean error: an HTTP status with an OpenAI error object, or an SSE error event); ``refused``
(no HTTP response at all: connection refused, or closed or reset before a status line, so nothing was
accepted);
``lost`` (anything else: a stream cut without an error event, a body that is not an OpenAI object, a hang).
Fault scenarios retry ``error``/``refused`` attempts whose code is retryable, as an OpenAI client does;
``lost`` is never retried and must stay 0. Deterministic requests (greedy, or seeded) of the same input
must produce the same text every time: a duplicated, skipped or mixed token shows up as ``corrupt``.

The package, by concern (the names below are re-exported here):

- ``processes``: ``LocalStack``, ``MODEL``, ``CPU_STACK_ENV``: the processes of the stack (started and stopped
  with ``kernellab.services.processes``).
- ``client``: the request mix (``Plan``, ``make_plans``), one attempt (``Attempt``, ``send``) and the
  closed-loop load (``Result``, ``LoadRun``).
- ``faults``: the fault injectors (``FAULTS``) and the hostile clients.
- ``report``: the idle check, the JSON artifact (``summarize``), the Markdown ``table`` and ``brief``.
- ``scenarios``: ``SCENARIOS`` and ``run_scenario``, which puts load, fault and report together.
"""

from kernellab.services.stress.client import (
    PROMPTS,
    RETRYABLE,
    Attempt,
    LoadRun,
    Plan,
    Result,
    make_plans,
    send,
)
from kernellab.services.stress.faults import (
    FAULTS,
    FaultEvent,
    fault_gateway_restart,
    fault_redis_restart,
    fault_slow_client,
    fault_vanishing_client,
    fault_worker_kill,
    fault_worker_pause,
)
from kernellab.services.stress.processes import CPU_STACK_ENV, MODEL, LocalStack
from kernellab.services.stress.report import SCHEMA, brief, idle_report, summarize, table
from kernellab.services.stress.scenarios import SCENARIOS, run_scenario

__all__ = [
    "CPU_STACK_ENV",
    "FAULTS",
    "MODEL",
    "PROMPTS",
    "RETRYABLE",
    "SCENARIOS",
    "SCHEMA",
    "Attempt",
    "FaultEvent",
    "LoadRun",
    "LocalStack",
    "Plan",
    "Result",
    "brief",
    "fault_gateway_restart",
    "fault_redis_restart",
    "fault_slow_client",
    "fault_vanishing_client",
    "fault_worker_kill",
    "fault_worker_pause",
    "idle_report",
    "make_plans",
    "run_scenario",
    "send",
    "summarize",
    "table",
]
