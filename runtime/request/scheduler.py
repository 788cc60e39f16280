"""Token-budget scheduler (no torch), after vLLM v1's rule: each step says how many tokens each request
runs; there are no prefill and decode phases, so chunked prefill falls out.

Order of a step: expire deadlines → running requests by priority (decode first; a request that needs a block
when none is free preempts the lowest-priority running request, which is recomputed later) → waiting requests
by (priority, arrival) while the token budget, ``max_num_seqs`` and free blocks allow. No new request is
admitted in a step that had to preempt.

Background requests (priority above 0: the Batch API's) yield step time to interactive ones. While an
interactive request is in the engine or came within ``foreground_window_s``, background prefill takes at most
``background_prefill_tokens`` per step, and none in a step that prefills an interactive request: an
interactive arrival then waits behind a short step, and its own first step is not lengthened by a wave of
batch prompts. Background decode rows always run. With background work alone the whole budget is theirs.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from kernellab.runtime.request.block_manager import BlockManager
from kernellab.runtime.request.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """What runs this step."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute now)
    preempted: list[Sequence] = field(default_factory=list)  # back to waiting, blocks freed
    finished: list[Sequence] = field(default_factory=list)  # ended by the scheduler (deadline) before running
    # A decode window (reserve_lookahead): ``window`` greedy steps back to back on the device, row i emitting at
    # most ``allowed[i]`` tokens (its KV slots are reserved for those). 1: one ordinary step.
    window: int = 1
    allowed: list[int] = field(default_factory=list)
    # A window launched before the previous window's tokens were read (asynchronous scheduling): each row has
    # ``ahead`` tokens in flight that its sequence does not hold yet, so its window starts that much further on.
    ahead: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def samples(self, seq: Sequence, n: int) -> bool:
        """Whether this chunk reaches the end of the sequence's tokens, so it yields a next token."""
        return seq.num_computed_tokens + n == seq.num_tokens


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        enable_chunked_prefill: bool = True,
        background_prefill_tokens: int | None = None,
        foreground_window_s: float = 5.0,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.chunked_prefill = enable_chunked_prefill
        # None: a sixteenth of the step budget (at least one block's worth of tokens).
        self.background_prefill_tokens = (
            max(16, max_num_batched_tokens // 16) if background_prefill_tokens is None else background_prefill_tokens
        )
        self.foreground_window_s = foreground_window_s
        self._foreground_seen = float("-inf")  # time.monotonic() of the latest interactive request
        self._foreground = 0  # interactive requests in the engine
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.num_preemptions = 0

    # ------------------------------------------------------------------ requests
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already running")
        self.requests[seq.request_id] = seq
        if seq.priority <= 0:
            self._foreground += 1
            self._foreground_seen = time.monotonic()
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        # key= computes only the keys the bisection visits (log n), not every waiting sequence's per insertion
        self.waiting.insert(bisect.bisect_right(self.waiting, seq.sort_key(), key=Sequence.sort_key), seq)

    def abort(self, request_id: str) -> Sequence | None:
        """End a request now and free its blocks; it is not reported by later steps."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        self._finish(seq, "abort")
        return seq

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        if self.requests.pop(seq.request_id, None) is not None and seq.priority <= 0:
            self._foreground -= 1
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        self.block_manager.free_sequence(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free_sequence(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ the step
    def schedule(self, now: float | None = None) -> SchedulerOutput:
        out = SchedulerOutput()
        now = time.time() if now is None else now
        for seq in [s for s in self.requests.values() if s.deadline is not None and s.deadline <= now]:
            self._finish(seq, "deadline")
            out.finished.append(seq)

        budget = self.max_num_batched_tokens
        # Background prefill allowance this step (see the module docstring); None: unlimited.
        background = self._background_allowance()
        foreground_prefill = False
        candidates = sorted(self.running, key=Sequence.sort_key)
        while candidates and budget > 0:
            seq = candidates.pop(0)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n > 1 and seq.priority > 0 and background is not None:  # a background prompt's next chunk
                n = min(n, 0 if foreground_prefill else background)
                if n == 0:
                    continue
                background -= n
            while not self.block_manager.allocate_slots(seq, n):
                victim = candidates.pop() if candidates else seq
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, n))
                budget -= n
                foreground_prefill |= n > 1 and seq.priority <= 0

        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cap = budget
            if seq.priority > 0 and background is not None:
                cap = min(cap, 0 if foreground_prefill else background)
                if cap <= 0:
                    break  # the waiting list is sorted: only background requests follow
            computed = self.block_manager.get_computed_blocks(seq)
            remaining = seq.num_tokens - len(computed) * self.block_manager.block_size
            if self.chunked_prefill:
                n = min(remaining, cap)
            elif remaining <= cap or not out.scheduled:
                n = remaining  # unchunked: a long prompt runs whole, alone if it must
            else:
                break
            if not self.block_manager.allocate_slots(seq, n, computed):
                break
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = len(computed) * self.block_manager.block_size
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
            if seq.priority > 0 and background is not None:
                background -= n
            foreground_prefill |= seq.priority <= 0 and n > 1
        return out

    def _background_allowance(self) -> int | None:
        """Prefill tokens background requests may take this step: unlimited unless interactive traffic is live
        (an interactive request in the engine, or one added within ``foreground_window_s``)."""
        if not self._foreground and time.monotonic() - self._foreground_seen > self.foreground_window_s:
            return None
        return self.background_prefill_tokens

    def reserve_lookahead(self, out: SchedulerOutput, width: int) -> None:
        """Look-ahead KV slots for a decode window of ``width`` steps (vLLM's ``num_lookahead_tokens``): each row
        gets slots for the tokens it may still emit (its max_tokens and the model length cap it), and
        ``out.window`` / ``out.allowed`` say so. All rows or none: when one row's blocks cannot be had, the step
        stays a single step (blocks reserved so far stay with their sequences and serve their next steps)."""
        if width <= 1:
            return
        allowed = self.reserve_ahead([seq for seq, _ in out.scheduled], 0, width)
        if allowed is not None:  # a scheduled row has its own step's slot already: at least that one
            out.window, out.allowed = width, [max(1, a) for a in allowed]

    def reserve_ahead(self, seqs: list[Sequence], ahead: int, width: int) -> list[int] | None:
        """Look-ahead KV slots for a window launched while each row still has ``ahead`` tokens in flight (the
        window before it, not read yet): row i may emit ``allowed[i]`` tokens after those, its max_tokens and the
        model length permitting (0: nothing left, no blocks taken). None when a row's blocks cannot be had
        (blocks reserved so far stay with their sequences and serve their next steps)."""
        allowed = []
        for seq in seqs:
            left = min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - ahead
            a = max(0, min(width, left))
            if a and not self.block_manager.allocate_slots(seq, ahead + a):
                return None
            allowed.append(a)
        return allowed

    def register_launched(self, out: SchedulerOutput) -> None:
        """The prompt blocks a launched step fills, into the prefix cache before its tokens are read (the engine
        calls this while the device computes; ``BlockManager.cache_full_blocks``): ``advance`` then finds them
        registered. Prefill chunks only: a decode row fills a block once in ``block_size`` steps."""
        for seq, n in out.scheduled:
            if n > 1 and not seq.is_finished:
                self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens + n)

    def advance(self, seq: Sequence, computed: int, token: int | None) -> bool:
        """``seq`` computed ``computed`` more tokens' KV and sampled ``token`` (None: a prefill chunk that does not
        reach the prompt's end). Appends it and ends the sequence on EOS, a stop token or its length. Returns
        False, changing nothing, when the sequence ended meanwhile (aborted between schedule and now)."""
        if seq.is_finished:
            return False
        seq.num_computed_tokens += computed
        self.block_manager.cache_full_blocks(seq)
        if token is None:
            return True
        seq.token_ids.append(token)
        reason, stop = self._stop_reason(seq, token)
        if reason:
            self._finish(seq, reason, stop)
        return True

    def advance_window(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """``advance(seq, 1, t)`` for each token of a decode window row, in one pass: the tokens up to the first
        that ends the sequence (EOS, a stop token, its length; checked in that order, as ``advance`` does) are
        appended and their KV counted as computed. Returns the tokens kept ([] when the sequence ended meanwhile).
        The host work per row per window is one scan and one block-hash pass instead of one of each per token
        (a 256-row, 8-step window advanced 2,048 tokens one by one)."""
        if seq.is_finished or not tokens:
            return []
        params = seq.params
        ends = set(params.stop_token_ids) if params.ignore_eos else self.eos_token_ids.union(params.stop_token_ids)
        limit = max(1, min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens))
        reason: str | None = None
        stop: int | None = None
        kept = tokens
        j = next((i for i, t in enumerate(tokens) if t in ends), None) if ends else None
        if j is not None and j < limit:
            kept, reason, stop = tokens[: j + 1], "stop", tokens[j]
        if reason is None and len(tokens) >= limit:
            kept, reason = tokens[:limit], "length"
        # the window computed the KV of the token before it and of every kept token but the last (advance's count)
        seq.token_ids.extend(kept)
        seq.num_computed_tokens += len(kept)
        self.block_manager.cache_full_blocks(seq)
        if reason:
            self._finish(seq, reason, stop)
        return kept

    def postprocess(self, out: SchedulerOutput, sampled: list[int | None]) -> list[Sequence]:
        """One ordinary step's bookkeeping: ``advance`` each scheduled sequence by its chunk and sampled token.
        Returns the sequences that finished."""
        finished = []
        for (seq, n), token in zip(out.scheduled, sampled, strict=True):
            if self.advance(seq, n, token) and seq.is_finished:
                finished.append(seq)
        return finished

    def _stop_reason(self, seq: Sequence, token: int) -> tuple[str | None, int | None]:
        params = seq.params
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop", token
        if token in params.stop_token_ids:
            return "stop", token
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def finish_by_stop_string(self, seq: Sequence, stop: str) -> None:
        self._finish(seq, "stop", stop)

    def finish_by_grammar(self, seq: Sequence) -> None:
        """The output completed its grammar (or the matcher failed): "stop" with no stop string or token."""
        self._finish(seq, "stop")

    def check_integrity(self) -> None:
        live = list(self.requests.values())
        self.block_manager.check_integrity(live)
        for seq in self.running:
            if len(seq.block_table) * self.block_manager.block_size < seq.num_computed_tokens:
                raise AssertionError(f"{seq}: block table shorter than its computed tokens")
        for seq in self.waiting:
            if seq.block_table:
                raise AssertionError(f"{seq}: waiting but holds blocks")
