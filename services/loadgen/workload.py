"""Synthetic request mix for load tests: prompt lengths and max_tokens drawn from weighted buckets.

A mix is ``prompt_words:max_tokens:weight`` entries, comma-separated: ``"128:128:3,1024:256:1"`` sends
three short requests for each long one. The load generator has no tokenizer (it stays torch- and
model-free), so prompts are sized in words; common English words are about one token each, and the real
prompt token counts come back in each response's ``usage``.

Every prompt starts with the same system message and differs after it, as chat traffic does, so the
server's prefix cache sees realistic sharing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SYSTEM_PROMPT = "You are a helpful assistant. Answer clearly and concisely, in plain English."

_WORD_TEXT = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night "
    "point home water room mother area money story fact month lot right study book eye job word business "
    "issue side kind head house service friend father power hour game line end member law car city "
    "community name president team minute idea kid body information back parent face others level office "
    "door health person art war history party result change morning reason research girl guy moment air "
    "teacher force education foot boy age policy process music market sense nation plan college interest "
    "death experience effect use class control care field development role effort rate heart drug show "
    "leader light voice wife police mind price report decision son view relationship town road arm "
    "difference value building action model season society tax director position player record paper "
    "space ground form event official matter center couple site project activity star table need court "
    "oil situation cost industry figure street image phone data picture practice piece land product "
    "doctor wall patient worker news test movie north love support technology step baby computer type "
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class MixEntry:
    prompt_words: int
    max_tokens: int
    weight: float


@dataclass(frozen=True)
class RequestSpec:
    messages: list[dict]  # for /v1/chat/completions
    prompt: str  # the same text for /v1/completions
    max_tokens: int


def parse_mix(spec: str) -> tuple[MixEntry, ...]:
    """``"128:128:3,1024:256:1"`` → entries; the weight may be left out (1)."""
    entries = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        fields = part.split(":")
        if len(fields) not in (2, 3):
            raise ValueError(f"mix entry {part!r} must be prompt_words:max_tokens[:weight]")
        try:
            words, max_tokens = int(fields[0]), int(fields[1])
            weight = float(fields[2]) if len(fields) == 3 else 1.0
        except ValueError:
            raise ValueError(f"mix entry {part!r} must be prompt_words:max_tokens[:weight] numbers") from None
        if words < 1 or max_tokens < 1 or not weight > 0:
            raise ValueError(f"mix entry {part!r}: lengths must be >= 1 and the weight > 0")
        entries.append(MixEntry(words, max_tokens, weight))
    if not entries:
        raise ValueError("the mix is empty")
    return tuple(entries)


class Workload:
    """Draws requests from a mix; the same seed gives the same sequence of requests."""

    def __init__(self, mix: str | tuple[MixEntry, ...], seed: int = 0):
        self.mix = parse_mix(mix) if isinstance(mix, str) else tuple(mix)
        self._rng = random.Random(seed)
        self._counter = 0

    def next(self) -> RequestSpec:
        entry = self._rng.choices(self.mix, weights=[e.weight for e in self.mix])[0]
        self._counter += 1
        # A request number up front makes every prompt distinct right after the shared system prompt.
        words = [f"Request {self._counter}:", *self._rng.choices(_WORDS, k=entry.prompt_words)]
        text = " ".join(words) + ". Summarise the words above in one paragraph."
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}]
        return RequestSpec(messages, f"{SYSTEM_PROMPT}\n\n{text}\n", entry.max_tokens)
