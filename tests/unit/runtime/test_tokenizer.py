"""The torch-free tokenizer and detokenizer against transformers on the embedded model's tokenizer."""

from __future__ import annotations

import pytest

from kernellab.runtime.request.detokenizer import IncrementalDetokenizer
from kernellab.runtime.request.errors import InvalidRequestError
from kernellab.runtime.request.registry import resolve_model, wheel_file_path
from kernellab.runtime.request.tokenizer import load_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Ünïcödé — 日本語?"},
    ],
]


@pytest.fixture(scope="module")
def ours():
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer

    path = wheel_file_path(resolve_model("smollm2-135m"))
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_equals_transformers(ours, hf, messages):
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected if isinstance(expected, list) else expected["input_ids"]  # BatchEncoding in transformers 5
    assert ours.apply_chat_template(messages) == list(expected)


@pytest.mark.parametrize("text", ["Hello world", "  leading spaces and\ttabs\n", "emoji 🙂 and 中文", ""])
def test_encode_decode_equal_transformers(ours, hf, text):
    assert ours.encode(text) == hf(text)["input_ids"]
    assert ours.decode(ours.encode(text)) == hf.decode(hf(text)["input_ids"], skip_special_tokens=True)


def test_stop_ids_come_from_the_gguf_metadata(ours):
    assert ours.eos_token_ids == [2]  # <|im_end|>: where a chat turn ends


@pytest.mark.parametrize(
    "messages", [[], [{"role": "wizard", "content": "x"}], [{"role": "user", "content": 5}], "not a list"]
)
def test_bad_messages_are_typed_errors(ours, messages):
    with pytest.raises(InvalidRequestError):
        ours.apply_chat_template(messages)


def test_incremental_detokenizer_streams_the_exact_text(ours):
    text = "Multi-byte: é, 日本語, 🙂. Done."
    ids = ours.encode(text)
    detok = IncrementalDetokenizer(ours)
    assert "".join(detok.push([i]) for i in ids) + detok.flush() == text


@pytest.mark.parametrize(
    ("stop", "include", "expected"),
    [
        (["Paris"], False, "The capital is "),
        (["Paris"], True, "The capital is Paris"),
        (["is P", "capital"], False, "The "),
    ],
)
def test_stop_strings_never_leak_past_the_stop(ours, stop, include, expected):
    ids = ours.encode("The capital is Paris. More text after.")
    detok = IncrementalDetokenizer(ours, stop=stop, include_stop_str_in_output=include)
    streamed = ""
    for i in ids:
        streamed += detok.push([i])
        assert len(streamed) <= len(expected)  # nothing past the stop is ever shown
    assert streamed + detok.flush() == expected
    assert detok.stopped


def test_transformers_loads_from_the_repository_root():
    """The repository root holds a top-level ``kernels/`` folder (``kernellab.kernels``). Run from the root, as
    pytest and ``python -c`` are, it comes first on ``sys.path``; a transformers that imports the Hub's ``kernels``
    distribution at load (5.25 does) would import this folder instead and fail. The pin in pyproject.toml keeps
    such a release out; this is what breaks if the pin is lifted without renaming the folder."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    assert (root / "kernels" / "__init__.py").is_file()
    code = "import transformers.integrations.hub_kernels, transformers.models.auto; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
