"""Engine step API, sampling semantics and bad input, on a tiny random checkpoint (fast)."""

from __future__ import annotations

import threading

import pytest

from kernellab.runtime.config import EngineConfig, ModelConfig
from kernellab.runtime.engine import LLMEngine
from kernellab.runtime.request.errors import ConfigError, ContextLengthError, InvalidRequestError, UnknownModelError
from kernellab.runtime.request.registry import resolve_model
from kernellab.runtime.request.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    return LLMEngine(
        model=str(tiny_checkpoints["qwen3"]), device="cpu", dtype="float32", num_kv_blocks=128, max_model_len=256
    )


def drain(engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.check_integrity()
    return tokens


def test_same_seed_same_tokens_whatever_the_batch(engine):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    engine.add_request("alone", [5, 6, 7], params)
    alone = drain(engine)["alone"]
    for i in range(5):
        engine.add_request(f"other{i}", [9 + i] * (3 + i), SamplingParams(temperature=1.0, max_tokens=12))
    engine.add_request("batched", [5, 6, 7], params)
    assert drain(engine)["batched"] == alone


def test_resume_from_emitted_tokens_continues_exactly(engine):
    params = SamplingParams(temperature=0.9, seed=99, max_tokens=10, ignore_eos=True, frequency_penalty=0.5)
    engine.add_request("full", [1, 2, 3, 4], params)
    full = drain(engine)["full"]
    engine.add_request("resumed", [1, 2, 3, 4], params, output_token_ids=full[:4])
    assert full[:4] + drain(engine)["resumed"] == full


def test_different_seeds_differ(engine):
    for seed in (1, 2):
        engine.add_request(
            f"s{seed}", [3, 3, 3], SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True)
        )
    out = drain(engine)
    assert out["s1"] != out["s2"]


def test_logprobs_are_reported_for_the_chosen_token_and_top_n(engine):
    engine.add_request("lp", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3, logprobs=4, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    for out in outputs:
        (lp,) = out.new_logprobs
        assert lp.token_id == out.new_token_ids[0]
        assert len(lp.top) == 4
        assert lp.top[0][0] == lp.token_id  # greedy: the chosen token is the most likely
        assert lp.logprob == pytest.approx(lp.top[0][1])
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:], strict=False))


def test_stop_token_ids_and_max_tokens(engine):
    engine.add_request("greedy", [4, 5, 6], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    greedy = drain(engine)["greedy"]
    assert len(greedy) == 6
    engine.add_request(
        "stop", [4, 5, 6], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop_token_ids=[greedy[2]])
    )
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [t for o in outs for t in o.new_token_ids] == greedy[: greedy.index(greedy[2]) + 1]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"


def test_abort_frees_everything(engine):
    engine.add_request("x", list(range(1, 60)), SamplingParams(max_tokens=50))
    engine.step()
    assert engine.stats().kv_cache_usage > 0
    assert engine.abort("x")
    assert engine.stats().kv_cache_usage == 0.0
    assert not engine.has_unfinished_requests()


def test_reset_prefix_cache_makes_the_same_prompt_compute_again(engine):
    prompt = list(range(100, 180))  # five full blocks of 16
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("first", prompt, params)
    first = [t for out in engine.step() for t in out.new_token_ids]  # the prefill step's token
    assert not engine.reset_prefix_cache()  # a request is running: refused, nothing dropped
    first += drain(engine)["first"]
    hits = engine.stats().prefix_cache_hits
    engine.add_request("hit", prompt, params)
    assert drain(engine)["hit"] == first and engine.stats().prefix_cache_hits > hits
    assert engine.reset_prefix_cache()
    hits = engine.stats().prefix_cache_hits
    engine.add_request("cold", prompt, params)
    assert drain(engine)["cold"] == first and engine.stats().prefix_cache_hits == hits


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"temperature": float("nan")}, "temperature"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": 50}, "top_logprobs"),
    ],
)
def test_bad_sampling_params_raise_typed_errors(kwargs, param):
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(**kwargs)
    assert exc.value.param == param
    assert exc.value.status_code == 400


def test_bad_prompts(engine):
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("e", [], SamplingParams())
    with pytest.raises(ContextLengthError, match="context"):
        engine.add_request("long", [1] * 256, SamplingParams())
    with pytest.raises(ContextLengthError) as exc:
        engine.add_request("mt", [1] * 10, SamplingParams(max_tokens=250))
    assert exc.value.param == "max_tokens"
    for bad in ([10**6], [1, -1], [1, True], [5, False], [1, 2.0], [1, "2"], [1, None], [2**70], [7, 0, 1, 9, True]):
        with pytest.raises(InvalidRequestError, match="token ids"):
            engine.add_request("vocab", bad, SamplingParams())
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request("resumed", [1, 2], SamplingParams(), output_token_ids=[3, 10**6])
    # Unpacked from the request protocol (ids known non-negative, maximum known): checked by that maximum, and
    # resumed output ids still one by one.
    from kernellab.runtime.request.token_ids import unpack_token_ids

    vocab = engine.model_config.vocab_size
    wire = lambda ids: unpack_token_ids(b"".join(i.to_bytes(4, "little") for i in ids))  # noqa: E731
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request("packed", wire([1, vocab]), SamplingParams())
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request("packed-resumed", wire([1, 2]), SamplingParams(), output_token_ids=[3, vocab])
    assert not engine.has_unfinished_requests()
    engine.add_request("packed-ok", wire([1, vocab - 1]), SamplingParams(max_tokens=1))
    assert engine.has_unfinished_requests()
    engine.abort("packed-ok")


def test_a_kv_pool_smaller_than_the_context_limits_requests_instead_of_hanging(tiny_checkpoints):
    """A pool of 4 blocks of 16 tokens under a 256-token context: a sequence longer than the pool could never be
    scheduled (it used to wait, or preempt itself, forever). The engine's context becomes the pool's size, so such
    requests are refused up front as too long, and the rest run."""
    small = LLMEngine(
        model=str(tiny_checkpoints["qwen3"]), device="cpu", dtype="float32", num_kv_blocks=4, max_model_len=256
    )
    assert small.max_model_len == 64 and small.scheduler.max_model_len == 64
    with pytest.raises(ContextLengthError, match="64 tokens"):
        small.add_request("too-long", [1] * 70, SamplingParams(max_tokens=1))
    with pytest.raises(ContextLengthError) as exc:
        small.add_request("grows-too-long", [1] * 40, SamplingParams(max_tokens=30))
    assert exc.value.param == "max_tokens"
    small.add_request("fits", [1] * 40, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    assert len(drain(small)["fits"]) == 24  # what the pool leaves after the prompt
    assert small.block_manager.num_free_blocks == 4


def test_prepared_on_another_thread_while_stepping_runs_as_added(engine):
    """The worker's I/O thread prepares requests while the loop thread steps; enqueued afterwards they run as
    add_request would have run them, and preparing touches no scheduler state."""
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)
    engine.add_request("direct", [4, 5, 6], params)
    direct = drain(engine)["direct"]
    engine.add_request("busy", list(range(1, 40)), SamplingParams(max_tokens=30, ignore_eos=True))
    prepared = []
    preparer = threading.Thread(target=lambda: prepared.append(engine.prepare_request("prepared", [4, 5, 6], params)))
    preparer.start()
    engine.step()
    while preparer.is_alive():
        engine.step()
    preparer.join()
    assert set(engine.scheduler.requests) == {"busy"}
    engine.add_prepared(prepared[0])
    assert drain(engine)["prepared"] == direct


def test_prepared_request_errors_match_add_request(engine):
    with pytest.raises(ContextLengthError):
        engine.prepare_request("long", [1] * 256, SamplingParams())
    engine.add_request("taken", [1, 2], SamplingParams(max_tokens=2))
    again = engine.prepare_request("taken", [1, 2], SamplingParams(max_tokens=2))  # the id is checked on enqueue
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_prepared(again)
    with pytest.raises(InvalidRequestError, match="already in use"):  # before the prompt, as it always was
        engine.add_request("taken", [], SamplingParams())
    drain(engine)


@pytest.mark.parametrize(
    "make",
    [
        lambda: EngineConfig(block_size=3),
        lambda: EngineConfig(max_num_seqs=0),
        lambda: EngineConfig(dtype="float8"),
        lambda: EngineConfig(device="tpu"),
        lambda: ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}),
    ],
)
def test_configuration_mistakes_are_server_errors_not_bad_requests(make):
    # The operator's settings, not a client's request: a 500 should one ever reach an HTTP response.
    with pytest.raises(ConfigError) as exc:
        make()
    assert not isinstance(exc.value, InvalidRequestError)
    assert exc.value.status_code == 500
    assert exc.value.to_openai()["error"]["type"] == "server_error"


def test_unknown_model_is_a_clear_error():
    with pytest.raises(UnknownModelError, match="unknown model 'gpt-17'"):
        resolve_model("gpt-17")
    with pytest.raises(UnknownModelError):
        resolve_model("")


def test_stop_string_on_the_last_allowed_token_reports_stop(smol_engine_fp32):
    from kernellab.runtime.request.sampling import SamplingParams as SP

    llm = smol_engine_fp32
    prompt = [{"role": "user", "content": "What is the capital of France?"}]
    free = llm.generate([prompt], SP(temperature=0.0, max_tokens=8))[0]
    # The last token that carries text: cap max_tokens right there and stop on that text.
    n = max(i + 1 for i, t in enumerate(free.token_ids) if llm.tokenizer.decode([t]).strip())
    last_piece = llm.tokenizer.decode(free.token_ids[n - 1 : n]).strip()
    out = llm.generate([prompt], SP(temperature=0.0, max_tokens=n, stop=[last_piece]))[0]
    assert out.finish_reason == "stop"
    assert last_piece not in out.text


def test_nucleus_filter_keeps_the_smallest_prefix_and_top_p_zero_keeps_the_top_token():
    import torch

    from kernellab.runtime.request.sequence import Sequence
    from kernellab.runtime.sampler import Sampler

    probs = torch.tensor([[0.05, 0.5, 0.3, 0.15]] * 3)
    seqs = [Sequence(str(i), [1, 2], SamplingParams(top_p=p), 4) for i, p in enumerate((0.0, 0.7, 0.85))]
    kept = (Sampler._filter(probs, seqs) > 0).tolist()
    assert kept == [[False, True, False, False], [False, True, True, False], [False, True, True, True]]


def test_the_sampler_takes_logits_in_the_models_dtype_and_computes_in_fp32():
    """Decode steps of several rows hand the sampler the LM head's bf16 values (no widening pass): greedy rows take
    their argmax as stored, and whatever computes with them (a bias, a mask, a temperature) widens first, so the
    tokens are those of the fp32 values."""
    import torch

    from kernellab.runtime.request.sequence import Sequence
    from kernellab.runtime.sampler import Sampler

    gen = torch.Generator().manual_seed(0)
    bf16 = (torch.randn(4, 300, generator=gen) * 8).to(torch.bfloat16)
    wide = bf16.float()
    bf16[1, 7] = bf16[1, 9] = bf16[1].max() + 1  # a tie: the lowest index wins in either dtype
    wide[1, 7] = wide[1, 9] = wide[1].max() + 1
    sampler = Sampler(torch.device("cpu"))

    def seqs(**params):
        return [Sequence(str(i), [1, 2], SamplingParams(**params), 4) for i in range(4)]

    greedy = seqs(temperature=0.0)
    assert sampler(bf16, greedy)[0] == sampler(wide, greedy)[0] == wide.argmax(-1).tolist()
    assert sampler(bf16, greedy)[0][1] == 7
    # a bias that fp32 keeps and bf16 would round away: 199 + 1.01 = 200.01 beats 200 in fp32, while in bf16
    # (steps of 1 there) it rounds to 200, a tie that the lower index 5 would win
    bf16[0, 5], bf16[0, 10] = 200.0, 199.0
    wide[0, 5], wide[0, 10] = 200.0, 199.0
    assert float(torch.tensor(199.0, dtype=torch.bfloat16) + torch.tensor(1.01, dtype=torch.bfloat16)) == 200.0
    biased = seqs(temperature=0.0, logit_bias={10: 1.01})
    assert sampler(bf16, biased)[0][0] == sampler(wide, biased)[0][0] == 10
    before = bf16.clone()
    hot = seqs(temperature=0.8, seed=3)
    assert sampler(bf16, hot)[0] == sampler(wide, hot)[0]
    assert torch.equal(bf16, before)  # the caller's logits are never written
