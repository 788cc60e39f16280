"""A request inside the engine (no torch)."""

from __future__ import annotations

import time
from array import array
from enum import Enum, auto
from typing import TYPE_CHECKING

import numpy as np

from kernellab.runtime.request.sampling import SamplingParams

if TYPE_CHECKING:
    from kernellab.runtime.request.outputs import TokenLogprob
    from kernellab.runtime.request.structured import GrammarState  # llguidance: imported once a grammar is used


def _int64_ids(prompt, output, checked: np.ndarray | None) -> array:
    """``Sequence.token_ids`` from what the request brought, without a Python int per id where it can (a list of
    2,048 ids took ~30 µs to convert on the CI box, inside a lone prompt's time to first token): the request check's
    int64 array of prompt and output ids as bytes, or the wire's uint32 ids (``TokenIds``) widened by numpy."""
    ids = array("q")
    if checked is not None and len(checked) == len(prompt) + len(output):
        ids.frombytes(np.ascontiguousarray(checked, dtype=np.int64).tobytes())
        return ids
    if isinstance(prompt, array) and prompt.itemsize == 4 and prompt.typecode in "IL":
        ids.frombytes(np.frombuffer(prompt, dtype=np.uint32).astype(np.int64).tobytes())
    else:
        ids.extend(prompt)
    ids.extend(output)
    return ids


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
        token_array: np.ndarray | None = None,
    ):
        self.request_id = request_id
        # prompt then output ids in a C array of int64 (a list's ids are references the garbage collector's young
        # collections walk one by one: 64 prompts of 512 tokens, 32,768 visits a collection; an array is no container)
        # (``token_array``: the same ids as the int64 array the request's check made, ``RequestLimits.check_ids``)
        self.token_ids = _int64_ids(prompt_token_ids, output_token_ids, token_array)
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
        # the chain hashes of the token prefix's full blocks computed so far, and those blocks' tokens as int64
        # bytes: a function of the tokens alone (they are only ever appended to), so the prefix-cache lookup and
        # the registration after the prefill share one pass, and a preempted sequence keeps them
        # (BlockManager.hash_chain). Neither holds a container per block (the garbage collector's walk).
        self.hash_chain: list[int] = []
        self.chain_bytes = bytearray()
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
        return self.token_ids[self.num_prompt_tokens :].tolist()

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self) -> tuple:
        """Lower sorts first: higher priority (lower value), then earlier arrival."""
        return (self.priority, self.arrival_time)
