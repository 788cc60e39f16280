"""Incremental detokenization with stop strings (no torch); the engine and the gateway share it.

Tokens arrive a few at a time; text is emitted only once it is stable: a window of tokens is decoded together
so multi-byte characters split across tokens come out whole (a trailing U+FFFD means "wait for more"), and
with stop strings the last ``max(len(stop)) - 1`` characters are held back until they cannot begin a stop
string, so a client never sees text past a stop.
"""

from __future__ import annotations

from typing import Protocol

# Prompt tokens decoded with the output as left context, so the first token's leading space survives.
_CONTEXT_TOKENS = 5


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_token_ids: list[int] | None = None,
        stop: list[str] | tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_token_ids or [])[-_CONTEXT_TOKENS:]
        self._tokens: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._include_stop = include_stop_str_in_output
        self.text = ""  # all stable output text so far (truncated at a stop string)
        self._emitted = 0
        self._searched = 0
        self.stopped = False
        self.stop_reason: str | None = None

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the new text that is safe to show. Nothing after a stop string."""
        if self.stopped:
            return ""
        for token_id in token_ids:
            self._tokens.append(token_id)
            self._decode_step()
            if self._check_stop():
                break
        end = len(self.text) if self.stopped else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def flush(self) -> str:
        """At the end of a request: the held-back tail (it cannot start a stop string any more)."""
        delta = self.text[self._emitted :]
        self._emitted = len(self.text)
        return delta

    def _decode_step(self) -> None:
        decode = self._tokenizer.decode
        prefix = decode(self._tokens[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip_special)
        full = decode(self._tokens[self._prefix_offset :], skip_special_tokens=self._skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._tokens)

    def _check_stop(self) -> bool:
        if not self._stop:
            return False
        start = max(0, self._searched - self._hold)
        best = None
        for stop in self._stop:
            idx = self.text.find(stop, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        self._searched = len(self.text)
        if best is None:
            return False
        idx, stop = best
        self.text = self.text[: idx + len(stop)] if self._include_stop else self.text[:idx]
        self._emitted = min(self._emitted, len(self.text))
        self.stopped = True
        self.stop_reason = stop
        return True
