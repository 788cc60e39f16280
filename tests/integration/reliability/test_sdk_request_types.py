"""Request bodies built from the official ``openai`` SDK's own request types (``CompletionCreateParams``, generated
from OpenAI's published API schema) by hypothesis, sent to the running stack: every answer is a 200 whose body the
SDK's response model accepts, or a 4xx OpenAI error object; never a 5xx. The model is pinned to ours and
``max_tokens`` kept small, so the bodies reach past the model check and the CPU stays bounded."""

from __future__ import annotations

import itertools
import os
from collections import Counter
from collections.abc import Iterable, Mapping

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from openai.types import Completion
from openai.types import completion_create_params as completion_params
from openai.types.chat import ChatCompletion
from openai.types.chat import completion_create_params as chat_params

from tests.support.reliability import MODEL, auth, is_openai_error

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("KERNELLAB_SDK_FUZZ_EXAMPLES", "40"))
STATUSES: Counter = Counter()


def plain(value):
    """What the SDK's types make (iterables, sets, tuples) as the JSON a client sends."""
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, bytes):
        return value.decode("latin-1")
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, Iterable):
        return [plain(v) for v in itertools.islice(value, 64)]
    return str(value)


def bounded(body: dict, cap: str) -> dict:
    body = {**plain(body), "model": MODEL}
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and body[key] > 4:
            body[key] = 4
    if not isinstance(body.get(cap), int):
        body[cap] = 4
    for key in ("n", "best_of"):
        if isinstance(body.get(key), int) and body[key] > 2:
            body[key] = 2
    return body


def check(resp: httpx.Response, model) -> None:
    STATUSES[resp.status_code] += 1
    assert resp.status_code < 500, resp.text[:500]
    if resp.status_code >= 400:
        is_openai_error(resp)
        return
    body = resp.json()
    for choice in body.get("choices", []):  # echo with logprobs: the first prompt token's logprob is null
        lp = choice.get("logprobs") if "text" in choice else None
        if lp and lp.get("token_logprobs", [0])[:1] == [None]:
            lp["token_logprobs"], lp["top_logprobs"] = lp["token_logprobs"][1:], lp["top_logprobs"][1:]
    model.model_validate(body)


SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=True,
    phases=[Phase.generate],
    suppress_health_check=list(HealthCheck),
)


@SETTINGS
@given(body=st.from_type(chat_params.CompletionCreateParamsNonStreaming))
def test_chat_bodies_from_the_sdk_types(rstack, body):
    resp = httpx.post(
        rstack.url + "/v1/chat/completions", json=bounded(body, "max_tokens"), headers=auth(), timeout=120
    )
    check(resp, ChatCompletion)


@SETTINGS
@given(body=st.from_type(completion_params.CompletionCreateParamsNonStreaming))
def test_completion_bodies_from_the_sdk_types(rstack, body):
    resp = httpx.post(rstack.url + "/v1/completions", json=bounded(body, "max_tokens"), headers=auth(), timeout=120)
    check(resp, Completion)


def test_sdk_bodies_were_answered_and_the_stack_still_serves(rstack):
    """Runs after the two above (file order): some bodies were served, and every worker is up."""
    assert STATUSES[200] > 0 and sum(STATUSES.values()) >= 2 * EXAMPLES, STATUSES
    assert rstack.ready_workers() == 2, rstack.log_tail()
