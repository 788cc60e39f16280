"""Constrained decoding and logit_bias through the engine, on the embedded SmolLM2-135M (fp32, CPU): outputs
follow their grammar whatever the sampling, unconstrained neighbours are untouched, and a request resumed from
its emitted tokens (failover) or recomputed after preemption continues exactly."""

from __future__ import annotations

import json
import logging
import re
from types import SimpleNamespace

import jsonschema
import pytest

from kernellab.runtime.engine import LLMEngine
from kernellab.runtime.model_runner import ModelRunner
from kernellab.runtime.request.errors import InvalidRequestError
from kernellab.runtime.request.sampling import SamplingParams
from kernellab.runtime.request.scheduler import SchedulerOutput
from kernellab.runtime.request.sequence import Sequence

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(smol_engine_fp32):
    return smol_engine_fp32


@pytest.fixture(scope="module")
def prompt(llm):
    return llm.encode([{"role": "user", "content": "Describe a person as JSON: name, age, favourite color."}])


def drain(engine: LLMEngine) -> dict[str, list]:
    """request id → [tokens, finish_reason]."""
    out: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            entry = out.setdefault(o.request_id, [[], None])
            entry[0].extend(o.new_token_ids)
            entry[1] = o.finish_reason if o.finished else None
    engine.check_integrity()
    return out


def test_json_schema_outputs_validate_and_leave_unconstrained_neighbours_unchanged(llm, prompt):
    plain = [SamplingParams(temperature=0.0, max_tokens=16), SamplingParams(temperature=1.0, seed=5, max_tokens=16)]
    alone = [o.token_ids for o in llm.generate([prompt] * 2, plain)]
    constrained = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=64, structured={"json_schema": PERSON}) for s in range(4)
    ]
    outs = llm.generate([prompt] * 6, [plain[0], *constrained, plain[1]])
    assert [outs[0].token_ids, outs[5].token_ids] == alone
    for o in outs[1:5]:
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), PERSON)
    assert len({o.text for o in outs[1:5]}) > 1  # the seeds still sample


def test_greedy_with_a_schema_is_the_argmax_of_the_masked_logits(llm, prompt):
    (free,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))
    assert not free.text.startswith("{")  # unconstrained, the model does not open an object
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=64, structured={"json_object": True}))
    assert out.finish_reason == "stop"
    assert isinstance(json.loads(out.text), dict)


def test_regex_outputs_fullmatch(llm, prompt):
    pattern = r"(yes|no), [0-9]{1,3}"
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=16, structured={"regex": pattern}) for s in (1, 2)]
    for o in llm.generate([prompt] * 2, params):
        assert o.finish_reason == "stop"
        assert re.fullmatch(pattern, o.text), o.text


def test_lark_grammar_with_embedded_json(llm, prompt):
    grammar = (
        'start: "Answer: " obj\n'
        'obj: %json {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["x"], '
        '"additionalProperties": false, "x-guidance": {"whitespace_flexible": false}}'
    )
    (o,) = llm.generate([prompt], SamplingParams(temperature=0.7, seed=3, max_tokens=32, structured={"lark": grammar}))
    assert o.finish_reason == "stop" and o.text.startswith("Answer: ")
    assert isinstance(json.loads(o.text[len("Answer: ") :])["x"], int)


def test_logit_bias_bans_and_forces(llm, prompt):
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    (base,) = llm.generate([prompt], greedy)
    first = base.token_ids[0]
    (banned,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, logit_bias={first: -100.0}))
    assert banned.token_ids[0] != first
    forced_id = llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = SamplingParams(temperature=1.0, seed=0, max_tokens=3, ignore_eos=True, logit_bias={forced_id: 100.0})
    (o,) = llm.generate([prompt], forced)
    assert o.token_ids == [forced_id] * 3


def test_resume_from_emitted_tokens_continues_exactly(llm, prompt):
    engine = llm.engine
    params = SamplingParams(
        temperature=1.0,
        seed=11,
        max_tokens=64,
        structured={"json_schema": PERSON},
        logit_bias={llm.tokenizer.encode("A", add_special_tokens=False)[0]: 5.0},
    )
    engine.add_request("full", prompt, params)
    full, reason = drain(engine)["full"]
    assert reason == "stop" and len(full) > 6
    engine.add_request("resumed", prompt, params, output_token_ids=full[:6])
    rest, reason = drain(engine)["resumed"]
    assert full[:6] + rest == full and reason == "stop"


def test_preemption_keeps_the_grammar(llm, prompt):
    engine = llm.engine
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=64, structured={"json_schema": PERSON})
    engine.add_request("ref", prompt, params)
    ref = drain(engine)["ref"][0]
    engine.add_request("pre", prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens += o.new_token_ids
        if len(tokens) == 5 and engine.scheduler.running:
            engine.scheduler._preempt(engine.scheduler.requests["pre"])  # recomputed from its tokens next step
    assert engine.scheduler.num_preemptions > 0
    assert tokens == ref


def test_bad_requests_are_rejected_before_they_run(llm, prompt):
    engine = llm.engine
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", prompt, SamplingParams(structured={"regex": "[a-"}))
    assert err.value.param == "response_format"
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", prompt, SamplingParams(logit_bias={engine.model_config.vocab_size: 1.0}))
    assert err.value.param == "logit_bias"
    assert not engine.has_unfinished_requests()


def test_a_failing_matcher_stops_the_sequence_not_the_step(llm, prompt, caplog):
    engine = llm.engine
    engine.add_request(
        "broken", prompt, SamplingParams(temperature=0.0, max_tokens=8, structured={"json_object": True})
    )
    engine.add_request("other", prompt, SamplingParams(temperature=0.0, max_tokens=3))
    grammar = engine.scheduler.requests["broken"].grammar
    outside = llm.tokenizer.encode("zzz", add_special_tokens=False)[0]  # no JSON object starts so
    grammar.consume = lambda tokens: grammar.matcher.consume_tokens([outside])  # as if the mask had been wrong
    with caplog.at_level(logging.WARNING):
        out = drain(engine)
    assert out["broken"][1] == "stop" and len(out["broken"][0]) == 1
    assert out["other"][1] == "length"
    assert "grammar matcher failed" in caplog.text


def test_multi_step_decode_falls_back_to_one_step_for_biased_or_constrained_rows():
    graphs = SimpleNamespace(decode_bucket=lambda n: 8, max_steps=16)
    runner = SimpleNamespace(graphs=graphs, use_graphs=True, max_window=8)  # num_scheduler_steps=8, max_steps=16

    def width(**extra) -> int:
        seqs = [
            Sequence(str(i), [1, 2, 3], SamplingParams(temperature=0.0, **(extra if i else {})), 32) for i in range(2)
        ]
        for s in seqs:
            s.num_computed_tokens = s.num_tokens - 1
        return ModelRunner.decode_window(runner, SchedulerOutput(scheduled=[(s, 1) for s in seqs]))

    assert width() == 8
    assert width(logit_bias={5: 1.0}) == 1
    assert width(structured={"json_object": True}) == 1
