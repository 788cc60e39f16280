"""The engine: ``schedule() → model_runner.execute(batch) → advance each row by its tokens``, plus the offline
``LLM`` front end. Synchronous and single-threaded: the worker drives ``step()`` from its loop."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kernellab.runtime import jit_watch
from kernellab.runtime.config import EngineConfig, ModelConfig
from kernellab.runtime.request.block_manager import BlockManager
from kernellab.runtime.request.detokenizer import IncrementalDetokenizer
from kernellab.runtime.request.errors import InvalidRequestError, ModelNotAvailableError
from kernellab.runtime.request.limits import RequestLimits
from kernellab.runtime.request.outputs import EngineStats, RequestOutput, TokenLogprob
from kernellab.runtime.request.registry import ModelSpec, resolve_model
from kernellab.runtime.request.sampling import SamplingParams
from kernellab.runtime.request.scheduler import Scheduler, SchedulerOutput
from kernellab.runtime.request.sequence import Sequence

if TYPE_CHECKING:
    from kernellab.runtime.host_gate import HostGate
    from kernellab.runtime.request.structured import GrammarState

log = logging.getLogger(__name__)


def load_model_config(spec: ModelSpec, random_weights: bool):
    """(ModelConfig, weight iterator or None). Random weights need no checkpoint: the registry has the shape."""
    from kernellab.runtime.loader import checkpoint_path, load_config, load_weights

    if random_weights:
        if spec.hf_config is None:
            path = checkpoint_path(spec)
            return load_config(path), None, path
        return ModelConfig.from_hf(spec.hf_config), None, None
    path = checkpoint_path(spec)
    cfg = load_config(path)
    return cfg, load_weights(path, cfg), path


def _int4_weights(cfg: EngineConfig, path, model_cfg: ModelConfig, device):
    """The Q4_1 codes for ``weight_quant="int4"``, or None; a clear error where it cannot apply."""
    if cfg.weight_quant == "none":
        return None
    from kernellab.runtime import quant
    from kernellab.runtime.loader import gguf_int4_weights
    from kernellab.runtime.request.errors import ConfigError

    if device.type != "cpu" or not quant.available():
        raise ConfigError("weight_quant='int4' runs on the CPU (PyTorch's int4pack matmul); use 'none' here")
    if cfg.random_weights or path is None or path.suffix != ".gguf":
        raise ConfigError(f"weight_quant='int4' needs a GGUF checkpoint with Q4_1/Q8_0 tensors; {cfg.model} has none")
    return gguf_int4_weights(path, model_cfg)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, weights=None, **kwargs):
        """``weights``: optional HF-named ``(name, tensor)`` pairs that replace the checkpoint's (for
        comparisons against a peer holding the same random weights)."""
        from kernellab.runtime.dispatch import ops_for_engine
        from kernellab.runtime.model_runner import ModelRunner, resolve_device, resolve_dtype

        self.config = cfg = config or EngineConfig(**kwargs)
        self.spec = resolve_model(cfg.model)
        self.model_name = self.spec.name
        self.last_schedule: tuple[int, int] | None = None  # (rows, tokens) of the last step: for step traces
        t0 = time.perf_counter()
        model_cfg, checkpoint, path = load_model_config(self.spec, cfg.random_weights)
        weights = checkpoint if weights is None else weights
        self.model_config = model_cfg
        limit = cfg.max_model_len or self.spec.max_model_len or model_cfg.max_position_embeddings
        self.max_model_len = min(limit, model_cfg.max_position_embeddings)
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device, self.spec.dtype)
        ops = ops_for_engine(cfg, device)
        int4 = _int4_weights(cfg, path, model_cfg, device)
        # Triton compiles after the runner's startup (graph capture and its warm-ups) stall the step that meets
        # them: counted in the stats and logged (runtime/jit_watch.py)
        self._jit = jit_watch.watch() if device.type == "cuda" else None
        with jit_watch.startup(self._jit):
            self.runner = ModelRunner(
                model_cfg, cfg, device, dtype, self.max_model_len, weights, ops, int4_weights=int4
            )
        pool = self.runner.num_blocks * cfg.block_size
        if pool < self.max_model_len:
            # A sequence longer than the whole pool could never be scheduled: it would wait (or preempt itself)
            # forever. Such requests are refused instead, as too long for this engine's context.
            log.warning(
                "the KV cache holds %d tokens, fewer than the %d-token context: requests are limited to %d tokens "
                "(raise gpu_memory_utilization or num_kv_blocks, or lower max_model_len)",
                pool,
                self.max_model_len,
                pool,
            )
            self.max_model_len = pool
        # the checks of prepare_request as plain data: no engine needed to run them
        self.request_limits = RequestLimits(model_cfg.vocab_size, self.max_model_len)
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        eos = set(model_cfg.eos_token_ids)
        if not cfg.random_weights:
            try:
                eos |= set(self.tokenizer.eos_token_ids)
            except (ModelNotAvailableError, FileNotFoundError):
                log.warning("no tokenizer for %s: token ids in, token ids out", self.spec.name)
        self.eos_token_ids = tuple(sorted(eos))
        self.block_manager = BlockManager(self.runner.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            background_prefill_tokens=cfg.background_prefill_tokens,
        )
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        # Asynchronous scheduling: the decode window launched and not read yet (step() collects it first).
        self.async_scheduling = cfg.async_scheduling
        self._window: tuple[SchedulerOutput, Any] | None = None
        self.prompt_tokens = 0
        self.generation_tokens = 0
        log.info(
            "engine ready: %s on %s/%s, %d KV blocks, %.1fs",
            self.spec.name,
            device,
            dtype,
            self.runner.num_blocks,
            time.perf_counter() - t0,
        )

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from kernellab.runtime.request.tokenizer import load_tokenizer

            with self._tokenizer_lock:  # prepare_request may ask from another thread
                if self._tokenizer is None:
                    self._tokenizer = load_tokenizer(self.spec)
        return self._tokenizer

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        deadline: float | None = None,
        output_token_ids=(),
    ) -> None:
        if isinstance(request_id, str):  # checked first, as always
            self._check_new_id(request_id)
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

    def prepare_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        deadline: float | None = None,
        output_token_ids=(),
    ) -> PreparedRequest:
        """``add_request`` without the enqueue: validate, build the sequence, its grammar state and stop-string
        detokenizer. It reads only the engine's fixed configuration, so another thread may call it while
        ``step()`` runs (the worker's I/O thread does, while the device computes); ``add_prepared`` then
        enqueues it on the engine's thread. Raises what ``add_request`` raises, but for a duplicate id."""
        params = params or SamplingParams()
        max_tokens, ids = self.request_limits.check_ids(request_id, prompt_token_ids, params, output_token_ids)
        return self.prepare_checked(
            request_id, prompt_token_ids, params, max_tokens, priority, deadline, output_token_ids, token_array=ids
        )

    def prepare_checked(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        priority: int = 0,
        deadline: float | None = None,
        output_token_ids=(),
        token_array=None,
    ) -> PreparedRequest:
        """``prepare_request`` for a request ``request_limits.check`` passed (which returned ``max_tokens``): build
        the sequence, its grammar state and stop-string detokenizer. ``token_array``: its ids as the check's int64
        array (``check_ids``), from which the sequence's ids are copied without a Python int per id."""
        seq = Sequence(
            request_id,
            prompt_token_ids,
            params,
            max_tokens,
            priority,
            deadline,
            output_token_ids,
            token_array=token_array,
        )
        if params.structured is not None:
            seq.grammar = self._grammar_state(params.structured, output_token_ids)
        detok = None
        if params.stop:
            detok = IncrementalDetokenizer(
                self.tokenizer, list(prompt_token_ids), params.stop, params.include_stop_str_in_output
            )
            detok.push(list(output_token_ids))
        return PreparedRequest(seq, detok)

    def add_prepared(self, prepared: PreparedRequest) -> None:
        """Enqueue a ``prepare_request`` result: the only part of ``add_request`` that touches the scheduler."""
        seq = prepared.seq
        self._check_new_id(seq.request_id)
        if prepared.detokenizer is not None:
            self._detokenizers[seq.request_id] = prepared.detokenizer
        self.scheduler.add(seq)

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")

    def _grammar_state(self, spec: dict, output_token_ids):
        from kernellab.runtime.request import structured

        try:
            tokenizer = self.tokenizer
        except (ModelNotAvailableError, FileNotFoundError):
            raise InvalidRequestError(
                f"structured output needs {self.spec.name}'s tokenizer, which is not here", param=structured.PARAM
            ) from None
        lltok = structured.ll_tokenizer(tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        return structured.GrammarState(lltok, spec, output_token_ids)

    def abort(self, request_id: str) -> bool:
        self._detokenizers.pop(request_id, None)
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            seq.grammar = None
        return seq is not None

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache (idle engines only; False, and nothing dropped, while requests run)."""
        return not self.scheduler.has_unfinished and self.block_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        # a window in flight is collected by the next step, even when every row of it has ended meanwhile
        return self.scheduler.has_unfinished or self._window is not None

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One scheduler step: schedule, reserve look-ahead slots when the runner can decode a window of steps
        on the device, run, then take each row's tokens one by one (EOS, stop tokens, length and stop strings
        end a row there; what the window computed past that is discarded) and advance grammars.

        Asynchronous scheduling (``EngineConfig.async_scheduling``): a decode window's next window is launched
        before this one's tokens are read, so the device decodes on while the host reads, emits and schedules.
        A step that finds a window in flight collects it (launching the one after it where it may) instead of
        scheduling anew."""
        if self._window is not None:
            return self._collect(self._window)
        out = self.scheduler.schedule()
        self.last_schedule = (len(out.scheduled), out.num_batched_tokens)
        results = [self._output(seq, [], None) for seq in out.finished]
        if not out.scheduled:
            return results
        self.scheduler.reserve_lookahead(out, self.runner.decode_window(out))
        self.prompt_tokens += sum(n for s, n in out.scheduled if s.num_computed_tokens < s.num_prompt_tokens)
        if out.window > 1 and self.async_scheduling:
            return results + self._collect((out, self.runner.launch_window(out)))
        sampled, logprobs = self.runner.execute(out, lambda: self.scheduler.register_launched(out))
        return results + self._advance(out, sampled, logprobs)

    def _collect(self, window: tuple[SchedulerOutput, Any]) -> list[RequestOutput]:
        """Read a launched window's tokens and advance its rows, having first launched the window after it where
        one may run (``_launch_next``): that one then decodes while this one's rows are advanced and emitted."""
        out, handle = window
        self._window = self._launch_next(out)
        return self._advance(out, self.runner.window_tokens(handle), {})

    def _launch_next(self, out: SchedulerOutput) -> tuple[SchedulerOutput, Any] | None:
        """The window after ``out``'s, launched now, or None where the next step must be scheduled: a request
        waits that the next step could take in (``_could_admit``; it joins one window later than without the
        look-ahead), a row's deadline has passed, no row runs on past ``out``'s window, or the KV blocks cannot be
        had. Rows that end inside ``out``'s window by their length are left out; rows that end there otherwise
        (EOS, a stop string, an abort) are not known yet: what the next window computes for them is discarded
        when it is read. Each row continues from its last token in ``out``'s window, still on the device."""
        now = time.time()
        rows = [
            i
            for i, ((seq, _), a) in enumerate(zip(out.scheduled, out.allowed, strict=True))
            if a == out.window and not seq.is_finished
        ]
        if self.scheduler.waiting:
            # rows that end by their length inside the window in flight: their seats and blocks come free
            ending = [s for (s, _), a in zip(out.scheduled, out.allowed, strict=True) if a < out.window]
            if self._could_admit([s for s in ending if not s.is_finished]):
                return None  # the next scheduled step takes it in
        if any((d := out.scheduled[i][0].deadline) is not None and d <= now for i in rows):
            return None  # schedule() ends it
        ahead = out.window  # tokens in flight per row: ``out``'s window (the one before it has been read)
        allowed = self.scheduler.reserve_ahead([out.scheduled[i][0] for i in rows], ahead, out.window)
        if allowed is None:
            return None
        keep = [i for i, a in zip(rows, allowed, strict=True) if a]
        if not keep:
            return None
        nxt = SchedulerOutput(
            scheduled=[(out.scheduled[i][0], 1) for i in keep],
            window=out.window,
            allowed=[a for a in allowed if a],
            ahead=ahead,
        )
        self.last_schedule = (len(keep), len(keep))
        return nxt, self.runner.launch_window(nxt, carry=keep)

    def _could_admit(self, ending: list[Sequence]) -> bool:
        """Whether the next scheduled step could take the first waiting request in: a seat and free blocks for its
        first chunk, counting those of the ``ending`` rows (they end inside the window in flight). With every seat
        taken (a server past its max_num_seqs) waiting requests do not stop the look-ahead: they could not join
        before a row ends anyway."""
        sched, bm = self.scheduler, self.block_manager
        if len(sched.running) - len(ending) >= sched.max_num_seqs:
            return False
        seq = sched.waiting[0]
        chunk = min(seq.num_tokens, sched.max_num_batched_tokens)
        return bm.num_free_blocks + sum(len(s.block_table) for s in ending) >= bm.blocks_needed(chunk)

    def _advance(self, out: SchedulerOutput, sampled: list[list[int]], logprobs) -> list[RequestOutput]:
        results: list[RequestOutput] = []
        emitted: list[list[int]] = []
        constrained: list[tuple[Sequence, GrammarState, int]] = []  # grammars take their tokens together, in parallel
        for (seq, n), tokens in zip(out.scheduled, sampled, strict=True):
            kept: list[int] = []
            if not tokens:  # a prefill chunk that does not reach the prompt's end
                self.scheduler.advance(seq, n, None)
            elif len(tokens) > 1 and seq.request_id not in self._detokenizers and seq.grammar is None:
                # a decode window's row without stop strings or a grammar: its tokens end only at EOS, a stop
                # token or its length, which the scheduler finds in one scan
                kept = self.scheduler.advance_window(seq, tokens)
                self.generation_tokens += len(kept)
                tokens = []
            for j, token in enumerate(tokens):
                if not self.scheduler.advance(seq, n if j == 0 else 1, token):
                    break  # aborted between schedule and now
                kept.append(token)
                self._check_stop_strings(seq, token)
                if seq.is_finished:
                    break
            emitted.append(kept)
            if kept and seq.grammar is not None and not (seq.is_finished and seq.finish_reason != "length"):
                constrained.append((seq, seq.grammar, kept[-1]))  # a grammar row decodes one token per step
        if constrained:
            self._advance_grammars(constrained)
        for (seq, _), kept in zip(out.scheduled, emitted, strict=True):
            if kept:
                lp = logprobs.get(seq.request_id)
                results.append(self._output(seq, kept, [lp] if lp else None))
        return results

    def _check_stop_strings(self, seq: Sequence, token: int) -> None:
        """Count the token and run the request's stop strings over it. A stop string completed by the last
        allowed token still reports "stop" (the text was cut), not "length".

        The engine owns ending the generation at a stop string (no compute past it; a resumed request rebuilds
        this check from its emitted tokens in ``add_request``, so it stops at the same token); whoever makes the
        text (gateway, RunPod handler, ``LLM.generate``) runs the same detokenizer again to hold back and cut
        it. Why both runs stay: runtime/request/detokenizer.py's docstring. A token that already ended the sequence
        (EOS, a stop token) is not fed here."""
        self.generation_tokens += 1
        detok = self._detokenizers.get(seq.request_id)
        if detok is None or (seq.is_finished and seq.finish_reason != "length"):
            return
        detok.push([token])
        stop = detok.stop_reason  # set (with detok.stopped) once a stop string is complete
        if stop is None:
            return
        if seq.is_finished:
            seq.finish_reason, seq.stop_reason = "stop", stop
        else:
            self.scheduler.finish_by_stop_string(seq, stop)

    def _advance_grammars(self, rows: list[tuple[Sequence, GrammarState, int]]) -> None:
        """Feed each sampled token to its sequence's grammar (llguidance's thread pool when there are many); a
        completed grammar ends the sequence with "stop" (also when its last allowed token completed it). A matcher
        error ends that sequence too, never the step. EOS, stop tokens and stop strings were checked first."""
        from kernellab.runtime.request import structured

        accepted = structured.consume_all([(grammar, token) for _, grammar, token in rows])
        for (seq, grammar, token), ok in zip(rows, accepted, strict=True):
            if ok and not grammar.is_stopped:
                continue
            if grammar.is_error:
                log.warning(
                    "request %s: grammar matcher failed after token %d, stopping it: %s",
                    seq.request_id,
                    token,
                    grammar.error,
                )
            if seq.is_finished:
                seq.finish_reason, seq.stop_reason = "stop", None
            else:
                self.scheduler.finish_by_grammar(seq)

    def _output(self, seq: Sequence, tokens: list[int], logprobs) -> RequestOutput:
        if seq.is_finished:
            self._detokenizers.pop(seq.request_id, None)
            seq.grammar = None
        prompt_logprobs = None
        if tokens and seq.prompt_logprobs is not None:  # handed out once, with the first token
            prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
        return RequestOutput(
            seq.request_id,
            tokens,
            logprobs,
            seq.is_finished,
            seq.finish_reason,
            seq.stop_reason,
            seq.num_prompt_tokens,
            seq.num_output_tokens,
            seq.num_cached_tokens,
            prompt_logprobs,
        )

    @property
    def host_gate(self) -> HostGate | None:
        """When other threads' Python costs a step nothing (runtime/host_gate.py); None off CUDA."""
        return self.runner.host_gate

    @property
    def fast_path(self) -> dict:
        """CUDA graphs, decode window and Triton ops this model runs on, and why any is off (dispatch.fast_path)."""
        return self.runner.fast_path

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            bm.usage,
            bm.num_free_blocks,
            bm.num_blocks,
            bm.prefix_queries,
            bm.prefix_hits,
            self.scheduler.num_preemptions,
            self.prompt_tokens,
            self.generation_tokens,
            self._jit.after_ready if self._jit is not None else 0,
            self._jit.seconds_after_ready if self._jit is not None else 0.0,
        )

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()


@dataclass(frozen=True)
class PreparedRequest:
    """A request validated and built by ``LLMEngine.prepare_request``, not yet in the scheduler."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer | None  # stop strings: the engine's own check (``_check_stop_strings``)


@dataclass
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None  # SamplingParams.prompt_logprobs: prompt tokens 1.. on


class LLM:
    """Offline generation: ``LLM("smollm2-135m").generate(prompts, SamplingParams(...))``.

    A prompt is a string, a list of token ids, or a list of chat messages (the chat template is applied)."""

    def __init__(self, model: str = "smollm2-135m", **engine_kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))
        self._counter = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty", param="prompt")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            return self.tokenizer.apply_chat_template(prompt)
        if isinstance(prompt, list | tuple):
            return list(prompt)
        raise InvalidRequestError(f"unsupported prompt type {type(prompt).__name__}", param="prompt")

    def generate(
        self, prompts, params: SamplingParams | list[SamplingParams] | None = None, on_step=None
    ) -> list[GenerationOutput]:
        single = isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int | dict)
        )
        prompts = [prompts] if single else list(prompts)
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        results: dict[str, GenerationOutput] = {}
        for prompt, p in zip(prompts, params_list, strict=True):
            ids = self.encode(prompt)
            rid = f"gen-{self._counter}"
            self._counter += 1
            self.engine.add_request(rid, ids, p)
            results[rid] = GenerationOutput(rid, ids)
        try:
            while self.engine.has_unfinished_requests():
                for o in self.engine.step():
                    r = results.get(o.request_id)
                    if r is None:
                        continue
                    r.token_ids.extend(o.new_token_ids)
                    r.logprobs.extend(o.new_logprobs or [])
                    if o.prompt_logprobs is not None:
                        r.prompt_logprobs = o.prompt_logprobs
                    if o.finished:
                        r.finish_reason = o.finish_reason
                        r.num_cached_tokens = o.num_cached_tokens
                if on_step:
                    on_step(sum(len(r.token_ids) for r in results.values()))
        finally:
            for rid in results:
                self.engine.abort(rid)
        for r, p in zip(results.values(), params_list, strict=True):
            if p.stop:
                detok = IncrementalDetokenizer(self.tokenizer, r.prompt_token_ids, p.stop, p.include_stop_str_in_output)
                r.text = detok.push(r.token_ids) + detok.flush()
            else:
                r.text = self.tokenizer.decode(r.token_ids)
        return list(results.values())
