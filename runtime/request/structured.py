"""Constrained decoding with llguidance (no torch): the grammar of a request's ``structured`` spec, the
tokenizer view llguidance needs, and one sequence's matcher.

The gateway imports this to reject a bad schema / regex / grammar with a 400 before the request is queued; the
engine builds a ``GrammarState`` per constrained sequence and, each step, fills a bitmask of the tokens that
keep the output a prefix of the grammar's language (``fill_bitmasks``), which the sampler applies to the logits.
"""

from __future__ import annotations

import json
from functools import lru_cache

import llguidance
import llguidance.numpy as llnp
import numpy as np

from kernellab.runtime.request.errors import InvalidRequestError

PARAM = "response_format"  # the OpenAI parameter a structured spec comes from
PARALLEL_ROWS = 4  # from this many constrained rows a step fills their masks on llguidance's thread pool
_executor: llguidance.LLExecutor | None = None


def _invalid(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=PARAM)


def grammar_for(spec: dict) -> str:
    """The llguidance grammar (a string for ``LLMatcher``) of one structured spec; cached, since the same
    schema arrives with many requests. Raises InvalidRequestError for a value of the wrong type or a JSON
    schema that is not an object; the grammar itself is checked by ``check`` / ``GrammarState``."""
    if not isinstance(spec, dict) or len(spec) != 1:
        raise _invalid("structured output takes exactly one of json_schema, json_object, regex, lark")
    ((kind, value),) = spec.items()
    if kind == "json_object":
        if value is not True:
            raise _invalid("json_object must be true")
        return _grammar("json_schema", '{"type":"object"}')
    if kind == "json_schema":
        if isinstance(value, str):
            return _grammar(kind, value)
        if not isinstance(value, dict):
            raise _invalid(f"json_schema must be an object, got {type(value).__name__}")
        try:
            # Not sort_keys: property order is the order the model writes them in, so it is part of the grammar.
            key = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise _invalid(f"json_schema is not JSON: {exc}") from None
        return _grammar(kind, key)
    if kind in ("regex", "lark"):
        if not isinstance(value, str) or not value:
            raise _invalid(f"{kind} must be a non-empty string")
        return _grammar(kind, value)
    raise _invalid(f"unknown structured output kind {kind!r}")


@lru_cache(maxsize=256)
def _grammar(kind: str, source: str) -> str:
    if kind == "json_schema":
        try:
            # Compact JSON (no whitespace between tokens): with flexible whitespace a sampled model can spend its
            # whole max_tokens on newlines and spaces inside an unfinished object, and the output is longer.
            return llguidance.LLMatcher.grammar_from_json_schema(source, defaults={"whitespace_flexible": False})
        except ValueError as exc:  # not JSON, or not an object schema
            raise _invalid(f"invalid json_schema: {exc}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(source)
    return llguidance.LLMatcher.grammar_from_lark(source)


def ll_tokenizer(tokenizer, vocab_size: int | None = None, eos_token_ids=None) -> llguidance.LLTokenizer:
    """llguidance's view of our ``TextTokenizer`` (cached: building it walks the vocabulary, ~0.3 s).
    ``vocab_size`` is the model's logits width, which may exceed the tokenizer's (Qwen3 pads to 151,936);
    the extra ids are never allowed. ``eos_token_ids``: the ids a grammar allows once it accepts."""
    vocab = tokenizer.vocab_size if vocab_size is None else vocab_size
    eos = tuple(sorted(tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids))
    return _ll_tokenizer(tokenizer, vocab, eos)


@lru_cache(maxsize=8)
def _ll_tokenizer(tokenizer, vocab_size: int, eos: tuple[int, ...]) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(tokenizer._tok.to_str(), n_vocab=vocab_size, eos_token=list(eos) or None)


def check(spec: dict, tokenizer, vocab_size: int | None = None, eos_token_ids=None) -> None:
    """Raise InvalidRequestError (param ``response_format``) with llguidance's reason when the spec does not
    compile into a grammar for this tokenizer; the gateway calls this before queueing a request."""
    error = _validation(grammar_for(spec), ll_tokenizer(tokenizer, vocab_size, eos_token_ids))
    if error:
        raise _invalid(f"invalid {next(iter(spec))} for structured output: {error}")


@lru_cache(maxsize=256)
def _validation(grammar: str, lltok: llguidance.LLTokenizer) -> str:
    """The error of an invalid grammar, "" for a valid one (warnings are not errors)."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
    return (messages[0] if messages else "unknown error") if is_error else ""


class GrammarState:
    """One sequence's matcher. ``output_token_ids``: tokens already emitted under this grammar (a request resumed
    on another worker), consumed here so the continuation is constrained exactly as it would have been."""

    def __init__(self, lltok: llguidance.LLTokenizer, spec: dict, output_token_ids=()):
        self.matcher = llguidance.LLMatcher(lltok, grammar_for(spec), log_level=0)
        if self.matcher.is_error():
            raise _invalid(f"invalid {next(iter(spec))} for structured output: {self.error}")
        if output_token_ids and not self.matcher.consume_tokens(list(output_token_ids)):
            raise _invalid(f"the tokens already emitted do not match the grammar: {self.error}")

    def consume(self, token_ids: list[int]) -> bool:
        """Advance by sampled tokens; False puts the matcher in its error state (see ``error``)."""
        return self.matcher.consume_tokens(list(token_ids))

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Row ``row`` of an int32 ``(rows, ceil(V/32))`` bitmask: bit t set where token t is allowed next."""
        llnp.fill_next_token_bitmask(self.matcher, bitmask, row)

    @property
    def is_stopped(self) -> bool:
        """Complete: nothing but EOS may follow (also true in the error state)."""
        return self.matcher.is_stopped()

    @property
    def is_error(self) -> bool:
        return self.matcher.is_error()

    @property
    def error(self) -> str:
        # Without the dump of the parser state that get_error() appends to a rejected token.
        return self.matcher.get_error().split("\n<state>", 1)[0].strip()


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    return llnp.allocate_token_bitmask(rows, vocab_size)


def fill_bitmasks(states: list[GrammarState], bitmask: np.ndarray) -> None:
    """Rows ``0..len(states)-1`` of ``bitmask`` (C-contiguous int32); many rows go to llguidance's thread pool
    (the fill releases the GIL, ~45 µs a row for JSON)."""
    global _executor
    if len(states) < PARALLEL_ROWS:
        for row, state in enumerate(states):
            state.fill_bitmask(bitmask, row)
        return
    if _executor is None:
        _executor = llguidance.LLExecutor()
    llnp.fill_next_token_bitmask_par(_executor, [(s.matcher, row) for row, s in enumerate(states)], bitmask)


def consume_all(pairs: list[tuple[GrammarState, int]]) -> list[bool]:
    """Advance each state by its sampled token; many go to llguidance's thread pool (a JSON matcher takes a few
    µs to tens of µs a token, 256 rows of them are milliseconds on one thread). False: that matcher failed."""
    global _executor
    if len(pairs) < PARALLEL_ROWS:
        return [state.consume([token]) for state, token in pairs]
    if _executor is None:
        _executor = llguidance.LLExecutor()
    return llnp.consume_token_par(_executor, [(state.matcher, token) for state, token in pairs])
