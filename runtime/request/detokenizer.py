"""Incremental detokenization with stop strings (no torch); the engine and the gateway share it.

Tokens arrive a few at a time; text is emitted only once it is stable: a window of tokens is decoded together
so multi-byte characters split across tokens come out whole (a trailing U+FFFD means "wait for more"), and
with stop strings the last ``max(len(stop)) - 1`` characters are held back until they cannot begin a stop
string, so a client never sees text past a stop.

Who checks stop strings. This class is the one owner of their meaning (the earliest match over all strings,
the hold-back while streaming, the cut before the string or after it with ``include_stop_str_in_output``).
Each request runs it twice, over the same token ids with the same prompt context and stop list, so both runs
end at the same token and the same character; the two runs do different jobs and are kept on purpose:

- Token side, ``LLMEngine._check_stop_strings``: it owns ending the generation. The sequence finishes at the
  token that completes a stop string (``finish_reason="stop"``, ``stop_reason`` = the string): no step, KV
  block or multi-step window tokens are spent past it, and the worker's chunk carrying that token is the final
  one. A resumed request rebuilds it from the tokens already emitted (``add_request(output_token_ids=...)``),
  so a reclaiming worker stops at the same token as an unfailed run. The engine has token ids, never text.
- Text side, the gateway's ``ResultStream`` (also the Batch API's ``collect``, which reads it), the RunPod
  handler and ``LLM.generate``: they own the text. The worker sends token ids only, so whoever makes the text
  holds back a possible stop-string prefix before the engine has decided anything (the next token may
  complete it) and cuts the text at the stop. A reported ``stop_reason`` cannot replace this run: (1) a token
  that ends the sequence as EOS or one of ``stop_token_ids`` is never fed to the engine's run (the scheduler
  ends the sequence first, ``stop_reason`` is then the token id), yet a non-special stop token's text is in
  the output and may complete a stop string, which only the text side then cuts; (2) a worker whose engine
  did not stop (another tokenizer than the gateway's, the tests' ``FakeEngine``) must still not leak text
  past a stop string, and the gateway cancels it (reason ``"stop_string"``) to free its KV blocks. With the
  real engine and the same tokenizer that cancel never fires. Trusting only ``stop_reason`` would change
  both outputs; relying on the gateway's cancel instead of the engine's check would spend steps past the
  stop (a Redis round trip, up to a multi-step window) and leave the offline ``LLM`` and the RunPod handler,
  which send no cancel, running to ``max_tokens``. docs/serving.md, "Stop strings", says the same.
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
