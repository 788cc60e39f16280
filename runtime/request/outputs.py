"""What an engine step gives back, and the step API every engine offers: no torch here, so the worker, the
gateway's tests and the fake engine share these types without importing the model.

``Engine`` is the contract the worker drives (``LLMEngine`` and the tests' fake engine both satisfy it):
add requests, step, abort, report stats; ``check_integrity`` runs when idle; ``last_schedule`` says what the
last step ran (rows, tokens) for step traces. ``add_request`` is ``prepare_request`` (validation and building,
safe on another thread while ``step`` runs; the worker's I/O thread calls it) then ``add_prepared`` (the enqueue,
on the engine's thread); the prepared value is the engine's own and only goes back to ``add_prepared``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kernellab.runtime.host_gate import HostGate
    from kernellab.runtime.request.sampling import SamplingParams


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "deadline"
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    # with the first output token of a request that asked for them: the logprob of every prompt token after the
    # first (and the top k at its position)
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    # Triton JIT compiles while serving (``runtime/jit_watch.py``): each one stalled the step that met it
    jit_compiles: int = 0
    jit_compile_seconds: float = 0.0


class Engine(Protocol):
    """The step API (runtime/engine.py's ``LLMEngine``; tests/support/fake_engine.py's ``FakeEngine``)."""

    max_model_len: int
    model_name: str
    last_schedule: tuple[int, int] | None
    host_gate: HostGate | None  # None: the worker's other threads never wait for its steps

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        deadline: float | None = None,
        output_token_ids=(),
    ) -> None: ...

    def prepare_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        deadline: float | None = None,
        output_token_ids=(),
    ) -> Any: ...

    def add_prepared(self, prepared: Any) -> None: ...

    def abort(self, request_id: str) -> bool: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def stats(self) -> EngineStats: ...

    def check_integrity(self) -> None: ...
