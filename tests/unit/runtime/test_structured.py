"""runtime/request/structured.py on the embedded model's tokenizer: grammars of each kind, validation errors as 400s,
and a matcher rebuilt from emitted tokens (failover) masking exactly like the one that emitted them."""

from __future__ import annotations

import numpy as np
import pytest

from kernellab.runtime.request import structured
from kernellab.runtime.request.errors import InvalidRequestError
from kernellab.runtime.request.registry import resolve_model
from kernellab.runtime.request.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model("smollm2-135m"))


@pytest.fixture(scope="module")
def lltok(tok):
    return structured.ll_tokenizer(tok)


def allowed(state: structured.GrammarState, vocab: int) -> np.ndarray:
    mask = structured.allocate_bitmask(1, vocab)
    state.fill_bitmask(mask, 0)
    return np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab].astype(bool)


@pytest.mark.parametrize(
    "spec",
    [
        {"json_schema": SCHEMA},
        {"json_object": True},
        {"regex": "[0-9]+"},
        {"lark": 'start: "x=" num\nnum: %json {"type": "integer"}'},
    ],
)
def test_every_kind_compiles_and_validates(spec, tok):
    assert isinstance(structured.grammar_for(spec), str)
    structured.check(spec, tok)


def test_grammars_are_cached_by_content_and_json_object_is_any_object():
    assert structured.grammar_for({"json_schema": dict(SCHEMA)}) is structured.grammar_for({"json_schema": SCHEMA})
    assert structured.grammar_for({"json_object": True}) == structured.grammar_for({"json_schema": {"type": "object"}})


def test_tokenizer_view_is_cached_and_covers_the_model_vocab(tok):
    assert structured.ll_tokenizer(tok) is structured.ll_tokenizer(tok)
    wide = structured.ll_tokenizer(tok, vocab_size=tok.vocab_size + 64, eos_token_ids=tok.eos_token_ids)
    assert wide.vocab_size == tok.vocab_size + 64
    state = structured.GrammarState(wide, {"json_object": True})
    assert not allowed(state, wide.vocab_size)[tok.vocab_size :].any()  # padding ids are never allowed


@pytest.mark.parametrize(
    "spec",
    [
        {"json_schema": {"type": "bogus"}},
        {"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}},
        {"json_schema": [1, 2]},
        {"json_schema": "not json"},
        {"json_object": "yes"},
        {"regex": "[0-9"},
        {"regex": ""},
        {"lark": "start: undefined_rule"},
        {"lark": 42},
        {"xml": "<a/>"},
    ],
)
def test_invalid_specs_are_invalid_requests_naming_response_format(spec, tok):
    with pytest.raises(InvalidRequestError) as err:
        structured.check(spec, tok)
    assert err.value.param == "response_format"
    assert err.value.status_code == 400


def test_rebuilt_from_emitted_tokens_masks_like_the_stepwise_matcher(tok, lltok):
    tokens = tok.encode('{"name":"Ann Lee","age":41}', add_special_tokens=False)
    stepwise = structured.GrammarState(lltok, {"json_schema": SCHEMA})
    for k, token in enumerate(tokens):
        rebuilt = structured.GrammarState(lltok, {"json_schema": SCHEMA}, tokens[:k])
        assert np.array_equal(allowed(rebuilt, lltok.vocab_size), allowed(stepwise, lltok.vocab_size)), k
        assert not stepwise.is_stopped
        assert stepwise.consume([token])
    assert stepwise.is_stopped and not stepwise.is_error


def test_emitted_tokens_outside_the_grammar_are_rejected(tok, lltok):
    with pytest.raises(InvalidRequestError, match="do not match the grammar"):
        structured.GrammarState(lltok, {"regex": "[0-9]+"}, tok.encode("abc", add_special_tokens=False))


def test_eos_only_once_the_grammar_accepts(tok, lltok):
    eos = tok.eos_token_ids[0]
    state = structured.GrammarState(lltok, {"regex": "[0-9]+"})
    assert not allowed(state, lltok.vocab_size)[eos]
    state.consume(tok.encode("7", add_special_tokens=False))
    assert allowed(state, lltok.vocab_size)[eos] and not state.is_stopped
    assert state.consume([eos]) and state.is_stopped


def test_parallel_fill_equals_row_by_row(tok, lltok):
    prefixes = ['{"', '{"name":"A', '{"name":"Bo","age":', "", '{"name":"x","age":12']
    states = [
        structured.GrammarState(lltok, {"json_schema": SCHEMA}, tok.encode(p, add_special_tokens=False))
        for p in prefixes
    ]
    assert len(states) >= structured.PARALLEL_ROWS
    par = structured.allocate_bitmask(len(states), lltok.vocab_size)
    structured.fill_bitmasks(states, par)
    for row, state in enumerate(states):
        one = structured.allocate_bitmask(1, lltok.vocab_size)
        state.fill_bitmask(one, 0)
        assert np.array_equal(par[row], one[0]), prefixes[row]
