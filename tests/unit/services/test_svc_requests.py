"""Gateway request validation: every bad input is a 4xx KernellabError with the right param."""

import pytest

from kernellab.runtime.request.errors import (
    ContextLengthError,
    InvalidRequestError,
    KernellabError,
    UnknownModelError,
)
from kernellab.services.gateway.requests import prepare

MODEL = "smollm2-135m"
MSGS = [{"role": "user", "content": "Hi"}]


def chat(tokenizer, **body):
    return prepare(
        "chat", {"model": MODEL, "messages": MSGS, **body}, tokenizer, served_model=MODEL, max_model_len=128, max_n=4
    )


def completion(tokenizer, **body):
    return prepare(
        "completion",
        {"model": MODEL, "prompt": "Hello", **body},
        tokenizer,
        served_model=MODEL,
        max_model_len=128,
        max_n=4,
    )


def test_chat_defaults(tokenizer):
    p = chat(tokenizer, some_unknown_field={"x": 1})
    assert p.kind == "chat" and p.request_id.startswith("chatcmpl-") and p.model == MODEL
    assert p.prompts == [tokenizer.apply_chat_template(MSGS)]
    [c] = p.choices
    assert c.params.max_tokens is None  # the rest of the context, not 16
    assert p.logprobs is None and not p.stream and p.priority == "interactive"


def test_chat_options(tokenizer):
    p = chat(
        tokenizer,
        max_completion_tokens=5,
        max_tokens=9,
        temperature=0,
        top_p=0.5,
        top_k=3,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=0.2,
        repetition_penalty=1.1,
        seed=7,
        stop="\n",
        n=3,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
        user="u",
        service_tier="flex",
    )
    assert [c.index for c in p.choices] == [0, 1, 2]
    assert [c.params.seed for c in p.choices] == [7, 8, 9]
    c = p.choices[0].params
    assert (c.max_tokens, c.temperature, c.top_p, c.top_k, c.min_p, c.stop) == (5, 0, 0.5, 3, 0.1, ["\n"])
    assert (c.presence_penalty, c.frequency_penalty, c.repetition_penalty, c.logprobs) == (0.5, 0.2, 1.1, 2)
    assert p.logprobs == 2 and p.stream and p.include_usage and p.priority == "batch"


def test_content_parts_are_joined(tokenizer):
    parts = [{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}]
    assert (
        prepare(
            "chat", {"model": MODEL, "messages": parts}, tokenizer, served_model=MODEL, max_model_len=128, max_n=1
        ).prompts
        == chat(tokenizer).prompts
    )


def test_completion_prompts(tokenizer):
    assert completion(tokenizer).prompts == [tokenizer.encode("Hello")]
    assert completion(tokenizer, prompt=[5, 6, 7]).prompts == [[5, 6, 7]]
    p = completion(tokenizer, prompt=["a", "b"], n=2, logprobs=1, echo=True)
    assert [(c.index, c.prompt_index) for c in p.choices] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert p.echo_text == ["a", "b"] and p.logprobs == 1 and p.request_id.startswith("cmpl-")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"n": 0}, "n"),
        ({"n": 5}, "n"),
        ({"seed": -1}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"model": 3}, "model"),
    ],
)
def test_bad_chat_bodies(tokenizer, body, param):
    with pytest.raises(InvalidRequestError) as info:
        chat(tokenizer, **body)
    assert info.value.status_code == 400
    assert info.value.param == param, info.value.message


def test_missing_fields(tokenizer):
    for kind, body, param in (
        ("chat", {"model": MODEL}, "messages"),
        ("chat", {"messages": MSGS}, "model"),
        ("completion", {"model": MODEL}, "prompt"),
    ):
        with pytest.raises(InvalidRequestError) as info:
            prepare(kind, body, tokenizer, served_model=MODEL, max_model_len=128, max_n=1)
        assert info.value.param == param and "missing" in info.value.message
    with pytest.raises(InvalidRequestError):
        prepare("chat", [1, 2], tokenizer, served_model=MODEL, max_model_len=128, max_n=1)


def test_unknown_model_is_404(tokenizer):
    for name in ("no-such-model", "qwen3-0.6b", "org/other"):
        with pytest.raises(UnknownModelError) as info:
            chat(tokenizer, model=name)
        assert info.value.status_code == 404 and info.value.code == "model_not_found"


def test_context_limits(tokenizer):
    prompt_len = len(chat(tokenizer).prompts[0])
    chat(tokenizer, max_tokens=128 - prompt_len)
    with pytest.raises(ContextLengthError) as info:
        chat(tokenizer, max_tokens=129 - prompt_len)
    assert info.value.param == "max_tokens" and info.value.status_code == 400
    with pytest.raises(ContextLengthError) as info:
        completion(tokenizer, prompt="word " * 200)
    assert info.value.param == "prompt"
    with pytest.raises(InvalidRequestError):
        completion(tokenizer, prompt="")
    with pytest.raises(InvalidRequestError):
        completion(tokenizer, prompt=[10**9])


def test_every_validation_error_is_4xx(tokenizer):
    bad = [{"max_tokens": {}}, {"messages": None}, {"stop": [1]}, {"n": None, "seed": 2**63}]
    for body in bad:
        with pytest.raises(KernellabError) as info:
            chat(tokenizer, **body)
        assert 400 <= info.value.status_code < 500


@pytest.mark.parametrize(
    "kind, body, param",
    [
        ("chat", {"modalities": ["text", "audio"]}, "modalities"),
        ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ("chat", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ("completion", {"suffix": " end"}, "suffix"),
    ],
)
def test_parameters_not_honoured_are_refused_by_name(tokenizer, kind, body, param):
    """No silent drops: a parameter that would change the answer and is not implemented is a 400 naming it."""
    with pytest.raises(InvalidRequestError) as info:
        (chat if kind == "chat" else completion)(tokenizer, **body)
    assert info.value.param == param and info.value.code == "unsupported_parameter"


def test_neutral_values_of_unsupported_parameters_are_accepted(tokenizer):
    chat(
        tokenizer,
        functions=[],
        function_call="none",
        response_format={"type": "text"},
        logit_bias={},
        modalities=["text"],
    )
    chat(tokenizer, function_call="auto", modalities=[])  # nothing to call, no modality asked for
    completion(tokenizer, suffix=None, best_of=2, n=2)
    completion(tokenizer, best_of=1)


def test_completion_without_max_tokens_generates_the_apis_default_16(tokenizer):
    assert completion(tokenizer).choices[0].params.max_tokens == 16
    assert completion(tokenizer, max_tokens=None).choices[0].params.max_tokens == 16
    long = "word " * 118  # leaves fewer than 16 tokens of the 128-token context
    room = 128 - len(completion(tokenizer, prompt=long, max_tokens=1).prompts[0])
    assert 1 <= room < 16 and completion(tokenizer, prompt=long).choices[0].params.max_tokens == room
    assert chat(tokenizer).choices[0].params.max_tokens is None  # chat: the rest of the context


@pytest.mark.parametrize(
    "body, param, shape",
    [
        ({"prompt": {}}, "prompt", "a list of token-id lists (got dict)"),
        ({"prompt": [{}]}, "prompt", "a list of token-id lists"),
        ({"stop": [{}]}, "stop", "a string or a list of strings"),
    ],
)
def test_fields_of_several_shapes_say_which_shapes_they_take(tokenizer, body, param, shape):
    with pytest.raises(InvalidRequestError) as info:
        completion(tokenizer, **body)
    assert info.value.param == param and shape in info.value.message and "str:" not in info.value.message


def test_echo_with_logprobs_scores_the_prompt_and_max_tokens_0_generates_nothing(tokenizer):
    [c] = completion(tokenizer, echo=True, logprobs=2).choices
    assert c.params.prompt_logprobs == 2
    assert completion(tokenizer, logprobs=2).choices[0].params.prompt_logprobs is None  # no echo: not scored
    assert completion(tokenizer, echo=True).choices[0].params.prompt_logprobs is None  # no logprobs asked for
    p = completion(tokenizer, max_tokens=0, echo=True, logprobs=0)
    # the engine makes one token, which the answer leaves out
    assert p.discard_output and p.choices[0].params.max_tokens == 1 and p.choices[0].params.prompt_logprobs == 0
    assert not completion(tokenizer, max_tokens=1).discard_output
    with pytest.raises(InvalidRequestError) as info:
        chat(tokenizer, max_tokens=0)  # chat has no echo: nothing to answer
    assert info.value.param == "max_tokens"


def test_completion_logprobs_put_the_echoed_prompt_first():
    from kernellab.services.gateway.responses import completion_logprobs

    def text(token_id):
        return {1: "Hi", 2: " there", 3: "!", 4: "?"}[token_id]

    lp = completion_logprobs([[3, -0.5, [[3, -0.5]]]], text, len("Hi there"), ([1, 2], [[2, -1.25, [[4, -0.75]]]]))
    assert lp == {
        "tokens": ["Hi", " there", "!"],
        "token_logprobs": [None, -1.25, -0.5],
        "top_logprobs": [None, {"?": -0.75}, {"!": -0.5}],
        "text_offset": [0, 2, 8],
    }


def test_best_of_makes_candidates_ranked_by_their_logprobs(tokenizer):
    p = completion(tokenizer, best_of=3, n=1, prompt=["a", "b"])
    assert p.best_of_keep == 1 and p.n_choices == 6 and [c.prompt_index for c in p.choices] == [0, 0, 0, 1, 1, 1]
    assert p.logprobs is None and all(c.params.logprobs == 0 for c in p.choices)  # ranked, not answered
    assert completion(tokenizer, best_of=2, n=2).best_of_keep is None  # best_of == n: nothing to rank
    for body in ({"best_of": 1, "n": 2}, {"best_of": 5}, {"best_of": 2, "stream": True}, {"best_of": "2"}):
        with pytest.raises(InvalidRequestError) as info:
            completion(tokenizer, **body)
        assert info.value.param == "best_of", body


def test_a_null_prompt_is_the_apis_default_document_boundary(tokenizer):
    assert completion(tokenizer, prompt=None).prompts == [tokenizer.encode("<|endoftext|>")]


def test_an_assistant_turn_may_leave_out_its_content(tokenizer):
    """The API requires only an assistant turn's role: without content it renders as its refusal, or empty."""
    user = {"role": "user", "content": "Hi"}

    def rendered(*turns):
        return tokenizer.decode(chat(tokenizer, messages=[user, *turns, user]).prompts[0])

    assert rendered({"role": "assistant"}) == rendered({"role": "assistant", "content": ""})
    refused = rendered({"role": "assistant", "content": None, "refusal": "I can't help with that."})
    assert refused == rendered({"role": "assistant", "content": "I can't help with that."})
