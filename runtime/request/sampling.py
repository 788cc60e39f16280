"""Sampling parameters (no torch): what a request asks for, validated once, serialisable for the queue."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from kernellab.runtime.request.errors import InvalidRequestError

MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries per request
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "lark")


@dataclass
class SamplingParams:
    max_tokens: int | None = None  # None: the rest of the context
    temperature: float = 1.0  # 0 → greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; n ≥ 0: the chosen token's plus the top n
    # None: off; k ≥ 0: every prompt token's logprob (from the first token's on, given the tokens before it) plus
    # the top k at its position (completions' echo with logprobs); such a prompt is computed whole, never taken
    # from the prefix cache
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    # token id → bias added to its logit before sampling (OpenAI's logit_bias; -100 bans, 100 forces)
    logit_bias: dict[int, float] | None = None
    # Constrained decoding (runtime/request/structured.py): exactly one of {"json_schema": {...}}, {"json_object": True},
    # {"regex": "..."}, {"lark": "..."}; every sampled token keeps the output a prefix of the grammar's language.
    structured: dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_logits_processors(self) -> bool:
        """Anything that changes the logits before sampling beyond temperature and filtering."""
        return bool(self.logit_bias) or self.structured is not None or self.has_penalties

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self) -> None:
        def bad(param: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {why}", param=param)

        def number(name: str, value, kind=(int, float)) -> None:
            if isinstance(value, bool) or not isinstance(value, kind):
                raise bad(name, f"must be a number, got {type(value).__name__}")
            if isinstance(value, float) and not math.isfinite(value):
                raise bad(name, "must be finite")

        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
                raise bad("max_tokens", "must be an integer")
            if self.max_tokens < 1:
                raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        number("temperature", self.temperature)
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        number("top_p", self.top_p)
        if not 0.0 <= self.top_p <= 1.0:  # 0: the most probable token only (the API's documented range is [0, 1])
            raise bad("top_p", f"must be in [0, 1], got {self.top_p}")
        number("top_k", self.top_k, int)
        if self.top_k < -1:
            raise bad("top_k", f"must be -1 (off), 0 (off) or positive, got {self.top_k}")
        number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            number(name, value)
            if not -2.0 <= value <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {value}")
        if self.seed is not None:
            number("seed", self.seed, int)
            if not 0 <= self.seed <= MAX_SEED:
                raise bad("seed", f"must be in [0, 2**63 - 1], got {self.seed}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise bad("stop", "must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise bad("stop", "must not contain empty strings")
        if len(self.stop) > 16:
            raise bad("stop", "takes at most 16 strings")
        if any(len(s) > 512 for s in self.stop):
            raise bad("stop", "strings must be at most 512 characters")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise bad("logit_bias", f"must be a map of at most {MAX_LOGIT_BIAS} token ids to biases")
            for token, bias in self.logit_bias.items():
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    raise bad("logit_bias", f"keys must be token ids (non-negative integers), got {token!r}")
                number("logit_bias", bias)
                if not -100.0 <= bias <= 100.0:
                    raise bad("logit_bias", f"values must be in [-100, 100], got {bias}")
        if self.structured is not None and (
            not isinstance(self.structured, dict)
            or len(self.structured) != 1
            or next(iter(self.structured)) not in STRUCTURED_KINDS
        ):
            raise bad("structured", f"must be one of {{{', '.join(k + ': ...' for k in STRUCTURED_KINDS)}}}")
        if self.logprobs is not None:
            number("logprobs", self.logprobs, int)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise bad("top_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None:
            number("prompt_logprobs", self.prompt_logprobs, int)
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise bad("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")

    def to_dict(self) -> dict:
        # Flat fields (lists of str/int at most): a shallow copy per list, not asdict's recursive deep copy,
        # which the gateway paid on every request.
        return {
            f.name: (list(v) if isinstance(v := getattr(self, f.name), list) else dict(v) if isinstance(v, dict) else v)
            for f in _FIELDS
        }

    @classmethod
    def from_dict(cls, data: dict) -> SamplingParams:
        kwargs = {k: v for k, v in data.items() if k in _NAMES}  # unknown keys (a newer writer's) are ignored
        bias = kwargs.get("logit_bias")
        if isinstance(bias, dict):  # JSON (batch files, RunPod input) has string keys; msgpack keeps ints
            try:
                kwargs["logit_bias"] = {int(k): v for k, v in bias.items()}
            except (TypeError, ValueError):
                raise InvalidRequestError("logit_bias keys must be token ids", param="logit_bias") from None
        return cls(**kwargs)


_FIELDS = fields(SamplingParams)
_NAMES = frozenset(f.name for f in _FIELDS)
