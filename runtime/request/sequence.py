"""A request inside the engine (no torch)."""

from __future__ import annotations

import time
from enum import Enum, auto
from typing import TYPE_CHECKING

import numpy as np

from kernellab.runtime.request.sampling import SamplingParams

if TYPE_CHECKING:
    from kernellab.runtime.request.outputs import TokenLogprob
    from kernellab.runtime.request.structured import GrammarState  # llguidance: imported once a grammar is used


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Token ids (prompt then output), how many have K/V in the cache, and the blocks holding them.

    Invariant: ``num_computed_tokens <= num_tokens``; the block table covers at least ``num_computed_tokens``
    slots while RUNNING and is empty while WAITING or FINISHED.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        priority: int = 0,
        deadline: float | None = None,
        output_token_ids: list[int] | tuple[int, ...] = (),
        arrival_time: float | None = None,
    ):
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids) + list(output_token_ids)
        # the same ids as an int64 array where the request's check made one (``RequestLimits.check_ids``): the first
        # ``len(token_array)`` of ``token_ids``, which only grow
        self.token_array: np.ndarray | None = None
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.priority = priority
        self.deadline = deadline
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit at first admission (reported in usage)
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chain hashes of the full, computed blocks registered so far
        # (chain hash, tokens) of the token prefix's full blocks computed so far: a function of the tokens alone
        # (they are only ever appended to), so the prefix-cache lookup and the registration after the prefill share
        # one pass, and a preempted sequence keeps it (BlockManager.hash_chain)
        self.hash_chain: list[tuple[int, tuple[int, ...]]] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.num_preemptions = 0
        # The request's structured.GrammarState, or None. It lives with the sequence (preemption keeps it: the
        # tokens it consumed are kept); the engine drops it when the sequence ends.
        self.grammar: GrammarState | None = None
        # Prompt logprobs (params.prompt_logprobs): one entry per prompt token after the first, filled by the runner
        # chunk by chunk; the engine hands them out once, with the first output token, and drops them. None: not
        # asked for, or delivered (also before this sequence was made: a resumed request that has emitted tokens).
        self.prompt_logprobs: list[TokenLogprob] | None = (
            [] if params.prompt_logprobs is not None and not output_token_ids else None
        )

    def __repr__(self) -> str:
        return f"Sequence({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens})"

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet (a prefix-cache hit would skip some)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self) -> tuple:
        """Lower sorts first: higher priority (lower value), then earlier arrival."""
        return (self.priority, self.arrival_time)
