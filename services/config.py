"""Settings of the serving stack (pydantic-settings): flags override ``KERNELLAB_*`` environment variables.

One class per service; the fields they share (Redis, key prefix, model, timing of heartbeats) live in
``StackSettings`` so a gateway and its workers agree on them when they read the same environment.
Importing this module imports no torch and no FastAPI.
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def parse_cpu_list(value: str) -> set[int]:
    """A Linux cpu list ("0-2,5") → the set of cores; "" → empty (no binding)."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in value.split(","))):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
            raise ValueError(f"cpus must be a cpu list such as '0-1,8-9', got {value!r}")
        cpus.update(range(int(lo), int(hi if sep else lo) + 1))
    return cpus


# Where the cores a process may be bound to are written: the cgroup's cpuset (a container's, cgroup v2 then v1),
# else the host's online cores. Not sched_getaffinity: a parent may have narrowed that, and a child may widen its
# own binding again anywhere inside the cpuset.
_CPUSET_FILES = (
    "/sys/fs/cgroup/cpuset.cpus.effective",
    "/sys/fs/cgroup/cpuset/cpuset.effective_cpus",
    "/sys/devices/system/cpu/online",
)


def bindable_cpus() -> set[int]:
    """The cores this process may bind itself to (see _CPUSET_FILES)."""
    for path in _CPUSET_FILES:
        try:
            cpus = parse_cpu_list(Path(path).read_text().strip())
        except (OSError, ValueError):
            continue
        if cpus:
            return cpus
    return set(range(os.cpu_count() or 1))


class StackSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KERNELLAB_", extra="ignore", validate_default=True)

    redis_url: str = DEFAULT_REDIS_URL
    key_prefix: str = "kl:"  # every Redis key starts with it; tests use their own to isolate themselves
    model: str = "smollm2-135m"
    metrics_host: str = "127.0.0.1"  # metrics ports bind here ("0.0.0.0" inside a container)
    heartbeat_interval_s: float = Field(1.0, gt=0)
    worker_dead_after_s: float = Field(5.0, gt=0)  # no heartbeat for this long: dead; its requests are reclaimed
    output_ttl_s: int = Field(600, ge=1)  # lifetime of kl:out:{id} after its last write
    request_timeout_s: float = Field(600.0, gt=0)  # per-request deadline from its arrival at the gateway
    log_level: str = "info"
    # KERNELLAB_GC_FREEZE: once started, move every object alive (modules, model, tokenizer) out of the garbage
    # collector's generations (observability.freeze_heap), so no full collection walks them while serving (155 ms a
    # walk on the CI box with the embedded model loaded). Off: Python's default (the serving benchmark's -nogcfreeze)
    gc_freeze: bool = True
    # Request-layer choices shared by the gateway, the batch runner and the RunPod handler:
    # KERNELLAB_GENERATION_CONFIG: "auto" takes sampling defaults (temperature, top_p, top_k, ...) from the model's
    # generation_config.json for requests that leave them out; "none": temperature 1, no filtering.
    generation_config: Literal["auto", "none"] = "auto"
    # KERNELLAB_CHAT_TEMPLATE_KWARGS, JSON: default template switches, e.g. '{"enable_thinking": false}'; a
    # request's chat_template_kwargs override them key by key.
    chat_template_kwargs: dict = Field(default_factory=dict)
    # KERNELLAB_REASONING_PARSER: "auto" splits <think> blocks into the reasoning field when the chat template
    # has them (Qwen3); "qwen3" always; "none" leaves them in the content.
    reasoning_parser: Literal["auto", "qwen3", "none"] = "auto"
    # KERNELLAB_TOOL_PARSER: "hermes" (= "auto") parses <tool_call> blocks (Qwen3's format); "none" refuses tools.
    tool_parser: Literal["auto", "hermes", "none"] = "auto"
    # KERNELLAB_CPUS: the CPU cores this process, its threads and its child processes run on, as a Linux cpu list
    # ("0-1,8-9"); empty: wherever the OS puts them. Keeps a worker's step loop off the cores its gateway and the
    # clients burst on, where a container's cpuset is not the way to say it (`kernellab worker` on a bare host).
    cpus: str = ""

    def serving_options(self, tokenizer):
        from kernellab.services.gateway.options import ServingOptions

        return ServingOptions.build(
            tokenizer,
            generation_config=self.generation_config,
            chat_template_kwargs=self.chat_template_kwargs,
            reasoning_parser=self.reasoning_parser,
            tool_parser=self.tool_parser,
        )

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, value: str) -> str:
        parse_cpu_list(value)  # a ValueError names what is wrong
        return value

    def pin_cpus(self) -> None:
        """Bind this process to ``cpus`` (before it starts threads or children: they inherit the binding)."""
        cpus = parse_cpu_list(self.cpus)
        if not cpus:
            return
        allowed = bindable_cpus()
        if cpus <= allowed:
            try:
                os.sched_setaffinity(0, cpus)
                return
            except OSError:
                pass
        # a core the host lacks, or outside the container's cpuset: say so, not EINVAL
        raise ValueError(
            f"KERNELLAB_CPUS={self.cpus!r} names cores this process may not run on: "
            f"{', '.join(map(str, sorted(cpus - allowed) or sorted(cpus)))} "
            f"(it may use {', '.join(map(str, sorted(allowed)))})"
        )

    @field_validator("key_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not value or any(c.isspace() for c in value):
            raise ValueError("key_prefix must be a non-empty string without spaces")
        return value


class GatewaySettings(StackSettings):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    gateway_metrics_port: int = Field(9100, ge=0, le=65535)  # KERNELLAB_GATEWAY_METRICS_PORT; 0: none
    api_keys: str = ""  # comma-separated; empty (and no file): no authentication
    api_key_file: str = ""  # one key per line; '#' starts a comment
    max_body_bytes: int = Field(1 << 20, ge=1024)
    max_waiting: int = Field(256, ge=0)  # admitted requests still waiting for their first token; beyond: 429
    # KERNELLAB_GATEWAY_PROCESSES: gateway processes sharing the port (SO_REUSEPORT), each with its own event
    # loop, Redis clients and output router; one supervisor serves their merged metrics. max_waiting is split
    # among them. One Python process frames a few thousand SSE events a second: docs/deploy.md says how many.
    gateway_processes: int = Field(1, ge=1, le=64)
    gateway_trace: str = ""  # KERNELLAB_GATEWAY_TRACE: a file for one JSON line per request (gateway/trace.py)
    # KERNELLAB_GATEWAY_FAST_PATH: the two generation routes skip FastAPI's routing and exception layers (app.py
    # GenerationFastPath); false serves them through FastAPI like every other route (the before of its A/B).
    gateway_fast_path: bool = True
    max_n: int = Field(16, ge=1)
    max_model_len: int | None = None  # None: the registry's context length for the model
    drain_timeout_s: float = Field(30.0, ge=0)

    def keys_in_use(self) -> list[str]:
        keys = [k.strip() for k in self.api_keys.split(",") if k.strip()]
        if self.api_key_file:
            for line in Path(self.api_key_file).expanduser().read_text().splitlines():
                line = line.split("#", 1)[0].strip()
                if line:
                    keys.append(line)
        return keys


class WorkerSettings(StackSettings):
    worker_id: str = ""  # "" → host-pid-random; must be unique among live workers (it is the consumer name)
    worker_metrics_port: int = Field(9200, ge=0, le=65535)  # KERNELLAB_WORKER_METRICS_PORT (+ /health); 0: none
    engine: str = "kernellab.runtime.engine:LLMEngine"  # "module:callable" taking an EngineConfig
    device: str = "auto"
    dtype: str = "auto"
    weight_quant: str = "none"  # KERNELLAB_WEIGHT_QUANT: "int4" reads a GGUF's 4-bit weights in small CPU steps
    # KERNELLAB_KV_CACHE_DTYPE: "int8" stores the KV cache as int8 with one scale per token and KV head (~1.9x the
    # tokens; it passes the numerics gate on the H200 and on real SmolLM2 weights), "fp8" as float8 e4m3 with the
    # same scales and bytes (it misses the gate; docs/gpu-engine.md)
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "int8"] = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    # While interactive traffic is live, Batch API prefill takes at most this many tokens per step (None: a
    # sixteenth of max_num_batched_tokens), so interactive requests wait behind short steps.
    background_prefill_tokens: int | None = Field(None, ge=1)
    num_kv_blocks: int | None = None
    block_size: int = Field(0, ge=0)  # 0: the cache's default (runtime/config.py default_block_size: 64 for int8)
    # KERNELLAB_PIECEWISE_GRAPHS: steps that prefill replay per-token-bucket CUDA graphs of the forward's row-wise
    # pieces, attention eager in between (GPU; off: they run eagerly, host-bound; the serving benchmark's A/B)
    piecewise_graphs: bool = True
    # KERNELLAB_FRESH_PROMPT_GRAPHS: a step of several fresh prompts (a burst's first step) replays one whole-step
    # CUDA graph (GPU; off: the piecewise graphs; the serving benchmark's -nofreshgraphs A/B)
    fresh_prompt_graphs: bool = True
    # KERNELLAB_ASYNC_SCHEDULING: a decode window's next window is launched before its tokens are read (GPU; off:
    # the device waits while the worker reads, emits and schedules each window; the serving benchmark's -sync A/B)
    async_scheduling: bool = True
    # KERNELLAB_KERNELS: which Triton kernels the engine's dispatcher enables on a GPU: "accepted" (each measured
    # correct and faster on the whole workload, runtime/kernel_status.json), "experimental" (those too), "none"
    # (the torch references). KERNELLAB_DISABLED_KERNELS: ops kept on torch whatever their status, comma-separated
    # (an operator's switch for one kernel, and the serving benchmark's A/B of one).
    # KERNELLAB_OUTPUT_WRITE_SLICE: at most this many output messages per fenced Redis write, first tokens first
    # (0: a step's whole batch in one write). A gateway's blocked read of a stream is answered only after the whole
    # write holding its entry (services/worker/io.py).
    output_write_slice: int = Field(0, ge=0)
    kernels: Literal["accepted", "experimental", "none"] = "accepted"
    disabled_kernels: Annotated[tuple[str, ...], NoDecode] = ()  # the engine refuses a name that is not an op

    @field_validator("disabled_kernels", mode="before")
    @classmethod
    def _op_names(cls, value):
        if isinstance(value, str):  # the environment's comma-separated list
            return tuple(name.strip() for name in value.split(",") if name.strip())
        return value

    max_deliveries: int = Field(3, ge=1)  # deliveries beyond this send a request to the dead-letter stream
    drain_timeout_s: float = Field(30.0, ge=0)
    batch_share: float = Field(0.75, gt=0, le=1)  # at most this share of max_num_seqs goes to batch requests
    # An idle engine that receives a request waits while more keep arriving, so a burst is prefilled in full
    # steps instead of a small step for its head that the rest then waits behind. The first wait is short
    # (gather_gap_s: what a lone request pays); once a second request has come, the quiet gap that ends the
    # gather is gather_burst_gap_s (a burst reaches a worker in pieces, one per gateway process's Redis flush),
    # and the whole gather is at most gather_max_s. It also ends once the first step holds gather_tokens prompt
    # tokens (None: a quarter of max_num_batched_tokens): enough to keep the device busy while the rest of the
    # burst arrives, to join the next step. Gathering up to the full step budget left the device idle while the
    # budget filled (docs/deploy.md, "Where the added TTFT goes").
    gather_gap_s: float = Field(0.001, ge=0)
    gather_burst_gap_s: float = Field(0.004, ge=0)
    gather_max_s: float = Field(0.05, ge=0)
    gather_tokens: int | None = Field(None, ge=1)
    # A quiet gap does not end the gather while the request reader is busy with a read (decoding and preparing
    # the tens of requests one XREADGROUP of a burst returns can outlast the gap, and the first step then ran
    # the burst's first request alone); gather_max_s still bounds it. Off: the gap alone decides (before).
    gather_follows_reader: bool = True
    # The I/O thread that reads a request prepares it (parameters, validation, the engine's sequence) while the
    # loop is in a step, so the loop only enqueues it between steps. Off: the loop prepares each as it takes it
    # in (the behaviour before; the serving benchmark's "-loopprep" phases measure the two against each other,
    # since the reader then holds the GIL while the step's Python launches kernels).
    prepare_in_reader: bool = True
    # The request reader decodes and prepares each request only while that costs the step loop nothing: while
    # the loop waits for work or a step waits for the device, not while the loop's Python launches, emits or takes
    # requests in (runtime/host_gate.py; engines on CUDA). Off by default: no TTFT gain measured on the H200 (the
    # module says why); the serving benchmark's "-gate" phases turn it on.
    reader_yields_to_step: bool = False
    # sys.setswitchinterval of the worker process: how long a thread that wants the GIL waits before the holder is
    # asked to drop it (Python's default is 5 ms). 0.1 ms measured no better on the H200 (docs/deploy.md).
    switch_interval_s: float = Field(0.0005, gt=0, le=0.1)
    # KERNELLAB_GC_IDLE_FREEZE: each time the engine runs out of work (nothing running or waiting, nothing in the
    # inbox), collect, then freeze what survived (observability.refreeze_heap), so the next burst's collections
    # walk only what it allocates. Objects alive at that moment are the process's long-lived state (no request is
    # in flight); one of them that later joins a reference cycle is freed only by a collection after
    # ``gc.unfreeze``. Off: on an H100 (c144059, docs/deploy.md) the burst's young collections got cheaper (0.2 ms
    # each against 0.8-1.8) and the added TTFT 0.4-1.0 ms lower in two runs, inside the runs' intervals.
    gc_idle_freeze: bool = False
    # KERNELLAB_GC_PROBE_MS: diagnosis of the collector's pauses. Each young collection first takes a census of what
    # it is about to walk (objects by type, references their containers hold; observability.young_census), and the
    # step trace keeps the census of every one that took at least this many ms (``gc_census``). The census lists
    # the young objects, which costs time of its own (~0.1-0.3 ms a collection): unset (off) when serving.
    gc_probe_ms: float | None = Field(None, ge=0)
    # After a step that produced first tokens, wait (at most this long) until they are written to Redis.
    first_token_flush_s: float = Field(0.005, ge=0)
    step_trace: str = ""  # KERNELLAB_STEP_TRACE: a file for one JSON line per step and request (worker/trace.py)
    # Niceness for the worker process (0: unchanged). `kernellab up` on a CPU sets 10: a worker sharing the
    # cores with the gateway and Redis must not delay their short jobs (delivering tokens) behind its steps.
    nice: int = Field(0, ge=0, le=19)

    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
