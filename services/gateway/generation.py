"""One request's life in the gateway: enqueue its choices, follow their output streams, detokenize, answer.

Invariants:
- Each choice's tokens are taken exactly once: a chunk whose ``seq`` is behind what we have is trimmed (a
  reclaiming worker may rewrite tokens a dead one already wrote); a chunk ahead of it is a protocol error.
- A choice ends at its worker's final chunk or at the first stop string our own detokenizer sees, whichever
  comes first; in the second case a cancel goes to the worker so it frees the KV blocks at its next step.
- Stop strings: the engine owns ending the generation (its chunk with the completing token is the final one,
  ``finish_reason="stop"``); this module owns the text: the worker sends token ids only, so our detokenizer,
  built with the same prompt context and stop list, holds back a possible stop-string prefix while streaming
  and cuts at the stop. It also cuts a stop string completed by an EOS / ``stop_token_ids`` token, which the
  engine's check never sees, and, should a worker not stop (another tokenizer, a test's fake engine), still
  cuts and cancels it (reason ``"stop_string"``). With the real engine that cancel never fires. Why the two
  checks are not merged: runtime/request/detokenizer.py's docstring.
- Whatever way the HTTP request ends (done, error, client gone), its subscription is dropped, the waiting and
  in-flight counts return, and unfinished choices are cancelled on the worker. A client that goes away is a
  ``ClientGone`` in the request's own queue (``ResultStream.client_gone``): whatever waits on the stream wakes
  and raises it, so no task races each wait against a disconnect watcher.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass, field

from kernellab.runtime.request.detokenizer import IncrementalDetokenizer
from kernellab.services.gateway import responses as R
from kernellab.services.gateway.errors import DeadlineExceeded, ServiceUnavailable, UpstreamError
from kernellab.services.gateway.output_parsers import ChatOutputParser, finish_delta, with_alias
from kernellab.services.gateway.requests import Prepared
from kernellab.services.gateway.router import RouterFailure, Subscription
from kernellab.services.queue.protocol import ErrorMessage, OutputChunk, engine_request_id

# A worker ends an expired request itself; this much later the gateway gives up waiting for it.
DEADLINE_GRACE_S = 5.0
NOT_READY = object()  # ``ResultStream.ready()``: nothing has arrived yet
_DEADLINE = object()  # put into a stream's queue when its deadline (plus the grace) has passed


class ClientGone(Exception):
    """The HTTP client disconnected before its answer ended."""


@dataclass
class Update:
    index: int
    text: str
    logprobs: list | None  # wire-format entries for the new tokens
    finish_reason: str | None
    token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list | None = None  # with the choice's first token: its prompt's entries (echo with logprobs)


@dataclass
class ChoiceState:
    detok: IncrementalDetokenizer
    next_index: int = 0
    finished: bool = False
    finish_reason: str | None = None
    cached_tokens: int = 0
    logprobs: list = field(default_factory=list)
    parser: ChatOutputParser | None = None  # chat: reasoning / content / tool calls
    prompt_logprobs: list | None = None


def chat_delta(st: ChoiceState, u: Update) -> tuple[dict, str | None]:
    """(the delta fields, the finish reason) of one update of a chat choice, through its output parser."""
    if st.parser is None:
        return ({"content": u.text} if u.text else {}), u.finish_reason
    delta = st.parser.feed(u.text, u.token_ids)
    if u.finish_reason is None:
        return with_alias(delta), None
    delta, reason = finish_delta(st.parser, delta, u.finish_reason)
    return with_alias(delta), reason


def echo_logprobs(p: Prepared, index: int, rs: ResultStream) -> tuple[list[int], list] | None:
    """(prompt token ids, their entries) of a completion choice that echoes its scored prompt, else None."""
    scored = rs.choices[index].prompt_logprobs
    if not p.echo_text or scored is None:
        return None
    return p.prompts[p.choices[index].prompt_index], scored


def usage_of(p: Prepared, rs: ResultStream) -> dict:
    reasoning = sum(c.parser.reasoning_tokens for c in rs.choices.values() if c.parser is not None)
    return R.usage(
        sum(len(x) for x in p.prompts),
        rs.completion_tokens,
        rs.cached_tokens,
        reasoning if p.parser is not None and p.parser.reasoning else None,
    )


class ResultStream:
    """Updates of every choice of a request, in arrival order; ``None`` once all have finished."""

    def __init__(
        self,
        gateway,
        p: Prepared,
        sub: Subscription,
        deadline: float,
        started: float,
        stamps: dict[str, float] | None = None,
    ):
        self.g, self.p, self.sub = gateway, p, sub
        self.deadline = deadline + DEADLINE_GRACE_S
        self.started = started
        tok = gateway.tokenizer
        parser = p.parser if p.parser is not None and (p.parser.reasoning or p.parser.tools) else None
        self.choices = {
            c.index: ChoiceState(
                IncrementalDetokenizer(
                    tok, p.prompts[c.prompt_index], c.params.stop, c.params.include_stop_str_in_output
                ),
                parser=ChatOutputParser(parser) if parser is not None else None,
            )
            for c in p.choices
        }
        self.remaining = len(self.choices)
        self.first_token_at: float | None = None
        self.closed = False
        # One timer for the whole request (not an asyncio.timeout per wait, which cost a timer handle and its
        # rescheduling on every event): at the deadline a marker in the queue wakes whatever waits on it.
        self._deadline_timer = asyncio.get_running_loop().call_later(
            max(0.0, self.deadline - time.time()), self.sub.queue.put_nowait, (None, _DEADLINE)
        )
        self.stamps = stamps  # the gateway trace's times (Gateway.submit), when the gateway traces

    @property
    def completion_tokens(self) -> int:
        if self.p.discard_output:
            return 0  # max_tokens 0: the engine's one token is not part of the answer
        return sum(c.next_index for c in self.choices.values())

    @property
    def cached_tokens(self) -> int:
        by_prompt: dict[int, int] = {}
        for c in self.p.choices:
            by_prompt[c.prompt_index] = max(by_prompt.get(c.prompt_index, 0), self.choices[c.index].cached_tokens)
        return sum(by_prompt.values())

    async def next(self) -> Update | None:
        while self.remaining:
            q = self.sub.queue
            index, msg = q.get_nowait() if not q.empty() else await q.get()
            update = self._apply(index, msg)
            if update is not None:
                return update
        return None

    def ready(self) -> Update | object | None:
        """The next update if one has already arrived, ``None`` once all choices have finished, else
        ``NOT_READY``: lets a writer that fell behind send what has queued up in one write."""
        q = self.sub.queue
        while self.remaining and not q.empty():
            update = self._apply(*q.get_nowait())
            if update is not None:
                return update
        return None if not self.remaining else NOT_READY

    def client_gone(self) -> None:
        """Called by the request's disconnect watcher: the next ``next()`` / ``ready()`` raises ClientGone."""
        self.sub.queue.put_nowait((None, ClientGone()))

    def _apply(self, index, msg) -> Update | None:
        if isinstance(msg, ClientGone):
            raise msg
        if msg is _DEADLINE:
            raise DeadlineExceeded()
        if isinstance(msg, RouterFailure):
            raise ServiceUnavailable(f"lost the connection to the queue: {msg}", code="queue_unavailable")
        st = self.choices[index]
        if st.finished:
            return None
        if isinstance(msg, ErrorMessage):
            raise UpstreamError(msg.status, msg.message, msg.type, msg.code, msg.param)
        if not isinstance(msg, OutputChunk):
            return None
        skip = st.next_index - msg.seq
        if skip < 0:
            raise ServiceUnavailable(f"choice {index} skipped tokens {st.next_index}..{msg.seq}", code="protocol_gap")
        tokens = msg.token_ids[skip:]
        logprobs = msg.logprobs[skip:] if msg.logprobs is not None else None
        st.next_index += len(tokens)
        if tokens and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
            self.g.first_token(self)
        prompt_logprobs = None
        if msg.prompt_logprobs is not None and st.prompt_logprobs is None:  # once (a reclaiming worker resends)
            st.prompt_logprobs = prompt_logprobs = msg.prompt_logprobs
        if self.p.discard_output:  # max_tokens 0: the prompt (echoed, scored) and nothing generated
            tokens, logprobs = [], None
        text = st.detok.push(tokens) if tokens else ""
        reason = None
        if st.detok.stopped:
            reason = "stop"
            if not msg.finished:
                self.g.cancel(self.p.request_id, index, "stop_string")
        elif msg.finished:
            text += st.detok.flush()
            reason = "length" if self.p.discard_output else msg.finish_reason
        if msg.finished:
            st.cached_tokens = msg.cached_tokens
        if reason is not None:
            if reason == "deadline":
                raise DeadlineExceeded()
            st.finished, st.finish_reason = True, reason
            self.remaining -= 1
        if (
            not text
            and not logprobs
            and prompt_logprobs is None
            and reason is None
            and not (tokens and st.parser is not None)
        ):
            return None
        if logprobs and (self.p.logprobs is not None or self.p.best_of_keep is not None):
            st.logprobs.extend(logprobs)  # kept to answer them, or to rank best_of's candidates
        return Update(index, text, logprobs if self.p.logprobs is not None else None, reason, tokens, prompt_logprobs)

    def close(self) -> None:
        """Idempotent: drop the subscription; cancel what has not finished (client gone, error)."""
        if self.closed:
            return
        self.closed = True
        self._deadline_timer.cancel()
        self.g.release(self)
        unfinished = [i for i, c in self.choices.items() if not c.finished]
        if unfinished:
            index = None if len(unfinished) == len(self.choices) else unfinished
            if index is None:
                self.g.cancel(self.p.request_id, None, "closed")
            else:
                for i in index:
                    self.g.cancel(self.p.request_id, i, "closed")
        self.g.forget_streams([engine_request_id(self.p.request_id, i) for i in self.choices])
        if self.stamps is not None:
            self.g.trace.request(
                self.p.request_id, {**self.stamps, "routed": self.sub.first_read, "first": self.first_token_at}
            )


async def collect(p: Prepared, rs: ResultStream, first: Update | None, token_text: R.TokenText) -> dict:
    """The whole (non-streaming) response body of a request, from its first update to its last. Shared by the
    HTTP route and the batch jobs (queue and offline), so a batch line's body is what the API would answer."""
    texts, reasons = defaultdict(list), {}
    update = first
    while update is not None:
        st = rs.choices[update.index]
        if st.parser is not None:
            _, reason = chat_delta(st, update)  # the parser keeps the parts; the result is read below
        else:
            texts[update.index].append(update.text)
            reason = update.finish_reason
        if reason is not None:
            reasons[update.index] = reason
        update = await rs.next()
    choices = []
    for c in p.choices:
        text = p.echo_of(c.index) + "".join(texts[c.index])
        entries = rs.choices[c.index].logprobs
        if p.kind == "chat":
            lp = R.chat_logprobs(entries, token_text) if p.logprobs is not None else None
            parser = rs.choices[c.index].parser
            message = parser.result() if parser is not None else None
            choices.append(R.chat_choice(c.index, text, lp, reasons.get(c.index), message))
        else:
            lp = None
            if p.logprobs is not None:
                lp = R.completion_logprobs(entries, token_text, len(p.echo_of(c.index)), echo_logprobs(p, c.index, rs))
            choices.append(R.completion_choice(c.index, text, lp, reasons.get(c.index)))
    if p.best_of_keep is not None:
        choices = best_of(p, choices, rs)
    return R.final_response(p, int(time.time()), choices, usage_of(p, rs))


def best_of(p: Prepared, choices: list[dict], rs: ResultStream) -> list[dict]:
    """best_of's answer: of each prompt's candidates, the ``best_of_keep`` with the highest mean logprob per
    generated token (the API's "highest log probability per token"), best first, numbered anew. Usage counts
    every candidate's tokens, as the API bills them."""
    assert p.best_of_keep is not None
    per_prompt = p.n_choices // len(p.prompts)

    def score(choice: dict) -> float:
        entries = rs.choices[choice["index"]].logprobs
        return sum(e[1] for e in entries) / len(entries) if entries else float("-inf")

    kept: list[dict] = []
    for first in range(0, len(choices), per_prompt):
        ranked = sorted(choices[first : first + per_prompt], key=score, reverse=True)[: p.best_of_keep]
        kept += [{**c, "index": len(kept) + j} for j, c in enumerate(ranked)]
    return kept
