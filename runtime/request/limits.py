"""What a request is checked against before it may run: the model's vocabulary and context (no torch, no engine).

``RequestLimits.check`` is the validation half of ``LLMEngine.prepare_request``; the building half is
``LLMEngine.prepare_checked``. The checks are plain data (picklable, no engine), so a request can be checked where no
engine lives: a request reader in its own process did so in the H200 A/B of docs/deploy.md.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np

from kernellab.runtime.request.errors import ContextLengthError, InvalidRequestError
from kernellab.runtime.request.sampling import SamplingParams
from kernellab.runtime.request.token_ids import TokenIds


def valid_token_ids(tokens: list[int], vocab: int) -> bool:
    """Integers (not bools) in ``[0, vocab)`` (``token_array``)."""
    return token_array(tokens, vocab) is not None


def token_array(tokens: list[int], vocab: int) -> np.ndarray | None:
    """``tokens`` as an int64 array if they are integers (not bools) in ``[0, vocab)``, else None. The engine keeps
    the array with the sequence: a prompt's graph fills its inputs from it (a list of 2,048 ids took ~35 µs more to
    convert, before the device could start). A C array of int64 takes integers only (a float, a string or None
    raises, as does an integer past int64), numpy takes the minimum and maximum; a bool would pass as 0 or 1, so
    only the ids of those values have their types looked at: ~35 µs for a 2,048-token prompt against ~90 for a
    type scan and Python's ``min``/``max``, inside a lone request's time to first token (a per-token generator
    once cost ~1.5 ms for 32 prompts of 512 tokens, on the worker's step thread between two steps)."""
    try:
        ids = np.frombuffer(array("q", tokens), dtype=np.int64)
    except (TypeError, OverflowError):
        return None
    if not ids.size:
        return ids
    if ids.min() < 0 or ids.max() >= vocab:
        return None
    return None if any(type(tokens[i]) is bool for i in np.flatnonzero(ids <= 1).tolist()) else ids


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int

    def check(self, request_id: str, prompt_token_ids, params: SamplingParams, output_token_ids=()) -> int:
        """Raise what is wrong with the request (``InvalidRequestError``, ``ContextLengthError``); else return the
        number of tokens it may generate (``max_tokens``, or what the context leaves)."""
        return self.check_ids(request_id, prompt_token_ids, params, output_token_ids)[0]

    def check_ids(
        self, request_id: str, prompt_token_ids, params: SamplingParams, output_token_ids=()
    ) -> tuple[int, np.ndarray | None]:
        """``check``, and the request's token ids (prompt then output) as the int64 array the check made of a plain
        list (None for ids unpacked from the wire, which are checked by their maximum)."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
        vocab, limit = self.vocab_size, self.max_model_len
        n_prompt = len(prompt_token_ids)
        if not n_prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        ids = None
        if isinstance(prompt_token_ids, TokenIds):  # unpacked from the wire: non-negative ints, maximum known
            valid = prompt_token_ids.max_id < vocab and (
                not output_token_ids or valid_token_ids(list(output_token_ids), vocab)
            )
        else:
            ids = token_array([*prompt_token_ids, *output_token_ids], vocab)
            valid = ids is not None
        if not valid:
            raise InvalidRequestError(f"token ids must be integers in [0, {vocab})", param="prompt")
        total = n_prompt + len(output_token_ids)
        if total >= limit:
            raise ContextLengthError(
                f"the prompt has {total} tokens; this model's context is {limit} tokens, which leaves no room to "
                "generate",
                param="prompt",
            )
        if params.max_tokens is None:
            max_tokens = limit - n_prompt
        elif n_prompt + params.max_tokens > limit:
            raise ContextLengthError(
                f"max_tokens={params.max_tokens} plus the prompt's {n_prompt} tokens exceeds the context of "
                f"{limit} tokens",
                param="max_tokens",
            )
        else:
            max_tokens = params.max_tokens
        if params.logit_bias and any(t >= vocab for t in params.logit_bias):
            raise InvalidRequestError(f"logit_bias keys must be token ids in [0, {vocab})", param="logit_bias")
        return max_tokens, ids
