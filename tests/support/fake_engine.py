"""A deterministic stand-in for ``LLMEngine`` with the same step API, for testing the worker and the queue
without loading a model: output token i of a request is ``prompt[(i + seed) % len(prompt)]`` (it echoes its
prompt), so a resumed request continues exactly; each step sleeps ``step_s`` like a decode step would."""

from __future__ import annotations

import os
import time

from kernellab.runtime.host_gate import HostGate
from kernellab.runtime.request.errors import ContextLengthError, InvalidRequestError
from kernellab.runtime.request.outputs import EngineStats, RequestOutput, TokenLogprob


class _Seq:
    def __init__(self, rid, prompt, params, deadline, emitted):
        self.rid, self.prompt, self.params, self.deadline = rid, prompt, params, deadline
        self.output = list(emitted)
        self.max_tokens = params.max_tokens


class FakeEngine:
    max_model_len = 256
    num_blocks = 64

    last_schedule = None  # no scheduler: step traces get no (rows, tokens)

    def __init__(self, config=None, step_s: float | None = None):
        self.config = config
        self.model_name = getattr(config, "model", "")
        self.step_s = float(os.environ.get("FAKE_STEP_S", "0.01")) if step_s is None else step_s
        self.max_model_len = int(os.environ.get("FAKE_MAX_MODEL_LEN", type(self).max_model_len))
        self.seqs: dict[str, _Seq] = {}
        self.generation_tokens = 0
        self.prompt_tokens = 0
        self.added: list[tuple[str, list[int], list[int]]] = []  # (id, prompt, output_token_ids) per add
        # The step's sleep stands for the device's work: the worker's reader may run through it, as on a GPU.
        self._device_until = 0.0
        self.host_gate = HostGate(lambda: time.monotonic() >= self._device_until)

    def add_request(self, request_id, prompt_token_ids, params, *, priority=0, deadline=None, output_token_ids=()):
        self.add_prepared(
            self.prepare_request(
                request_id,
                prompt_token_ids,
                params,
                priority=priority,
                deadline=deadline,
                output_token_ids=output_token_ids,
            )
        )

    def prepare_request(self, request_id, prompt_token_ids, params, *, priority=0, deadline=None, output_token_ids=()):
        prompt = list(prompt_token_ids)
        if not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if len(prompt) + len(output_token_ids) >= self.max_model_len:
            raise ContextLengthError("prompt too long", param="prompt")
        return _Seq(request_id, prompt, params, deadline, output_token_ids)

    def add_prepared(self, seq: _Seq) -> None:
        if seq.rid in self.seqs:
            raise InvalidRequestError("duplicate id")
        self.added.append((seq.rid, seq.prompt, list(seq.output)))
        self.prompt_tokens += len(seq.prompt)
        self.seqs[seq.rid] = seq

    def abort(self, request_id) -> bool:
        return self.seqs.pop(request_id, None) is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.seqs)

    def step(self):
        self._device_until = time.monotonic() + self.step_s
        with self.host_gate.device_wait():
            time.sleep(self.step_s)
        outs = []
        now = time.time()
        for _rid, s in list(self.seqs.items()):
            if s.deadline is not None and s.deadline <= now:
                outs.append(self._out(s, [], True, "deadline"))
                continue
            i = len(s.output)
            token = s.prompt[(i + (s.params.seed or 0)) % len(s.prompt)]
            s.output.append(token)
            self.generation_tokens += 1
            limit = s.max_tokens or (self.max_model_len - len(s.prompt))
            done = len(s.output) >= limit
            lp = None
            if s.params.logprobs is not None:
                lp = [TokenLogprob(token, -0.5, [(token, -0.5), (token + 1, -1.5)][: s.params.logprobs])]
            outs.append(self._out(s, [token], done, "length" if done else None, lp))
        return outs

    def _out(self, s, tokens, finished, reason, lp=None):
        if finished:
            del self.seqs[s.rid]
        return RequestOutput(s.rid, tokens, lp, finished, reason, None, len(s.prompt), len(s.output), 0)

    def stats(self) -> EngineStats:
        used = min(self.num_blocks, sum(-(-(len(s.prompt) + len(s.output)) // 16) for s in self.seqs.values()))
        return EngineStats(
            num_running=len(self.seqs),
            num_waiting=0,
            kv_cache_usage=used / self.num_blocks,
            num_free_blocks=self.num_blocks - used,
            num_total_blocks=self.num_blocks,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_preemptions=0,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
        )

    def check_integrity(self):
        pass
