"""Locust load test of kernellab's OpenAI-compatible API: streaming users, TTFT/ITL from the SSE chunks.

UI (compose profile ``loadtest``; or locally)::

    locust -f services/loadgen/locustfile.py --host http://127.0.0.1:8000

Headless, bounded in requests and time, with a JSON report (also ``headless.run_locust_headless``)::

    locust -f services/loadgen/locustfile.py --host http://127.0.0.1:8000 --headless -u 8 -r 8 \\
        --run-time 2m --max-requests 200 --loadgen-report out/loadgen.json --html out/locust.html

Every user streams one request after another (a closed loop). Each request is one Locust request entry
(its response time is the whole stream), plus custom entries ``time_to_first_token``,
``inter_token_latency`` and ``time_per_output_token`` (type ``SSE``) so the UI shows their percentiles.
Output tokens are counted from the final ``usage`` chunk, never from the chunks. Options below are also
environment variables (LOADGEN_*, KERNELLAB_API_KEY).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import gevent
from locust import HttpUser, constant, events, task
from locust.exception import StopUser

from kernellab.services.loadgen.sse import StreamResult, iter_sse_data
from kernellab.services.loadgen.stats import SLO, RequestRecord, format_table, summarize
from kernellab.services.loadgen.workload import Workload, parse_mix

log = logging.getLogger("kernellab.loadgen")


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    # On the parser itself: Locust's extra keywords (is_secret, include_in_web_ui) are not known to groups.
    group = parser
    group.add_argument(
        "--api-key",
        env_var="KERNELLAB_API_KEY",
        default="",
        is_secret=True,
        help="Bearer key for the gateway",
    )
    group.add_argument(
        "--model",
        env_var="LOADGEN_MODEL",
        default="",
        help="Model to ask for; empty: the first one /v1/models lists",
    )
    group.add_argument(
        "--mix",
        env_var="LOADGEN_MIX",
        default="128:128:3,1024:256:1",
        help="prompt_words:max_tokens:weight entries, comma-separated",
    )
    group.add_argument("--endpoint", env_var="LOADGEN_ENDPOINT", default="chat", choices=["chat", "completions"])
    group.add_argument("--temperature", env_var="LOADGEN_TEMPERATURE", type=float, default=0.0)
    group.add_argument(
        "--ignore-eos",
        env_var="LOADGEN_IGNORE_EOS",
        action="store_true",
        default=False,
        help="Ask for exactly max_tokens tokens (a kernellab/vLLM extension)",
    )
    group.add_argument("--seed", env_var="LOADGEN_SEED", type=int, default=0)
    group.add_argument(
        "--max-requests",
        env_var="LOADGEN_MAX_REQUESTS",
        type=int,
        default=0,
        help="Stop the run after this many requests have finished (0: no limit)",
    )
    group.add_argument("--request-timeout", env_var="LOADGEN_REQUEST_TIMEOUT", type=float, default=300.0)
    group.add_argument("--slo-ttft-ms", env_var="LOADGEN_SLO_TTFT_MS", type=float, default=None)
    group.add_argument("--slo-tpot-ms", env_var="LOADGEN_SLO_TPOT_MS", type=float, default=None)
    group.add_argument("--slo-e2e-ms", env_var="LOADGEN_SLO_E2E_MS", type=float, default=None)
    group.add_argument(
        "--loadgen-report",
        env_var="LOADGEN_REPORT",
        default="",
        include_in_web_ui=False,
        help="Write the run's summary (kernellab.services.loadgen.stats) to this JSON file",
    )


class _Run:
    """State of one test run shared by all users (Locust users are greenlets in one process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset(None)

    def reset(self, options) -> None:
        self.records: list[RequestRecord] = []
        self.issued = 0
        self.started = time.perf_counter()
        self.model: str | None = None
        seed = getattr(options, "seed", 0) if options else 0
        mix = getattr(options, "mix", None) if options else None
        self.workload = Workload(mix, seed) if mix else None


RUN = _Run()


@events.test_start.add_listener
def _on_test_start(environment, **_kwargs) -> None:
    options = environment.parsed_options
    parse_mix(options.mix)  # a bad mix fails the run here, before any user starts
    RUN.reset(options)


@events.test_stop.add_listener
def _on_test_stop(environment, **_kwargs) -> None:
    options = environment.parsed_options
    if options is None:
        return
    summary = summarize(
        RUN.records,
        time.perf_counter() - RUN.started,
        SLO(options.slo_ttft_ms, options.slo_tpot_ms, options.slo_e2e_ms),
    )
    summary["config"] = {
        "host": environment.host,
        "model": RUN.model,
        "endpoint": options.endpoint,
        "mix": options.mix,
        "users": options.num_users,
        "max_requests": options.max_requests,
        "ignore_eos": options.ignore_eos,
    }
    log.info("kernellab load run:\n%s", format_table(summary))
    if options.loadgen_report:
        path = Path(options.loadgen_report)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n")


class OpenAIStreamingUser(HttpUser):
    wait_time = constant(0)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        with RUN.lock:
            model = RUN.model or options.model or None
        if model is None:
            response = self.client.get("/v1/models", headers=self.headers, name="/v1/models")
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
        with RUN.lock:
            RUN.model = RUN.model or model

    @task
    def stream(self) -> None:
        options = self.environment.parsed_options
        with RUN.lock:
            if options.max_requests and RUN.issued >= options.max_requests:
                raise StopUser()
            RUN.issued += 1
            assert RUN.workload is not None  # test start built it (parse_mix refuses an empty mix)
            spec = RUN.workload.next()
        body = {
            "model": RUN.model,
            "max_tokens": spec.max_tokens,
            "temperature": options.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if options.ignore_eos:
            body["ignore_eos"] = True
        if options.endpoint == "chat":
            path, body["messages"] = "/v1/chat/completions", spec.messages
        else:
            path, body["prompt"] = "/v1/completions", spec.prompt
        result = StreamResult(start=time.perf_counter())
        with self.client.post(
            path,
            json=body,
            headers=self.headers,
            stream=True,
            catch_response=True,
            timeout=options.request_timeout,
            name=f"{path} (stream)",
        ) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {response.text[:200]}"
                result.finish()
            else:
                try:
                    # chunk_size=None: hand over each chunk as it arrives, so chunk times are arrival times.
                    for payload in iter_sse_data(response.iter_lines(chunk_size=None)):
                        result.feed(payload)
                        if result.error:
                            break
                except Exception as error:  # connection reset, timeout mid-stream
                    result.error = f"{type(error).__name__}: {error}"
                result.finish()
            # Locust timed only the headers (stream=True); the entry should cover the whole stream.
            assert result.e2e is not None  # finish() set the end
            response.request_meta["response_time"] = result.e2e * 1000
            if result.error:
                response.failure(result.error)
            else:
                response.success()
        self._record(result)

    def _record(self, result: StreamResult) -> None:
        record = RequestRecord(
            ok=result.error is None,
            error=result.error,
            ttft=result.ttft,
            itls=result.itls,
            e2e=result.e2e,
            prompt_tokens=result.prompt_tokens or 0,
            completion_tokens=result.completion_tokens or 0,
        )
        fire = self.environment.events.request.fire
        if record.ok:
            if record.ttft is not None:
                fire(
                    request_type="SSE",
                    name="time_to_first_token",
                    response_time=record.ttft * 1000,
                    response_length=0,
                    exception=None,
                    context={},
                )
            for gap in record.itls:
                fire(
                    request_type="SSE",
                    name="inter_token_latency",
                    response_time=gap * 1000,
                    response_length=0,
                    exception=None,
                    context={},
                )
            if record.tpot is not None:
                fire(
                    request_type="SSE",
                    name="time_per_output_token",
                    response_time=record.tpot * 1000,
                    response_length=record.completion_tokens,
                    exception=None,
                    context={},
                )
        options = self.environment.parsed_options
        with RUN.lock:
            RUN.records.append(record)
            done = options.max_requests and len(RUN.records) >= options.max_requests
        if done and self.environment.runner is not None:
            # From a user's greenlet, quit in a greenlet of its own: quitting stops this one too.
            gevent.spawn(self.environment.runner.quit)
