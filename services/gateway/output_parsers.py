"""Split a chat choice's generated text into reasoning, content and tool calls, as it streams.

Reasoning (Qwen3 and other ``<think>`` models): text inside ``<think>…</think>`` at the start of the output, or
from the start when the prompt already opened the block, goes to the message's ``reasoning`` field (also sent
as ``reasoning_content``, the older name many clients read); the rest is ``content``. A block cut off by
``max_tokens`` is all reasoning. With thinking switched off the template closes an empty block in the prompt, so
the output is all content.

Tool calls (Qwen3's format, which the gateway also teaches models whose template has no tools):
``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`` blocks in the content become ``tool_calls``; a block
whose JSON does not parse stays in the content as text, as the model wrote it.

``feed`` takes the text of each update and returns the delta to send now; text that may be the start of a tag
is held back until the next update decides it (a tag can arrive split across tokens and chunks), so the
concatenated deltas equal the non-streaming parse for any split of the same text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

THINK_START, THINK_END = "<think>", "</think>"
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ParserConfig:
    reasoning: bool = False  # the model thinks in <think> blocks
    reasoning_open: bool = False  # the prompt ends inside an open <think> block
    tools: bool = False  # parse <tool_call> blocks
    think_end_id: int | None = None  # the </think> token's id: counts reasoning tokens exactly
    # the tools came as the deprecated ``functions``: the first call is answered as ``function_call`` (name and
    # arguments), the finish reason "function_call"; that API has no place for a second call
    legacy_functions: bool = False


@dataclass
class ParsedMessage:
    reasoning: str | None
    content: str | None
    tool_calls: list[dict] = field(default_factory=list)
    reasoning_tokens: int = 0
    function_call: dict | None = None  # ParserConfig.legacy_functions: the call, in the deprecated form


class ChatOutputParser:
    """One choice's parser. States: ``start`` (may open a think block), ``reasoning``, ``after_think`` (drops the
    blank lines between the block and the answer), ``content``, ``tool`` (inside a tool-call block)."""

    def __init__(self, cfg: ParserConfig):
        self.cfg = cfg
        self.state = ("reasoning" if cfg.reasoning_open else "start") if cfg.reasoning else "content"
        self._held = ""  # text not yet assigned (a possible tag prefix, or leading whitespace)
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.tool_calls: list[dict] = []
        self.reasoning_tokens = 0
        self._counting = self.state in ("start", "reasoning")
        self._opened = self.state == "reasoning"  # a think block was opened (by the prompt or the output)

    @property
    def active(self) -> bool:
        return self.cfg.reasoning or self.cfg.tools

    # ------------------------------------------------------------------ streaming
    def feed(self, text: str, token_ids: list[int] | None = None) -> dict:
        """The delta fields (``reasoning``, ``content``, ``tool_calls``) that ``text`` completes."""
        was_reasoning = self.state in ("start", "reasoning")
        delta = self._run(self._held + text, final=False)
        self._count(text, token_ids, was_reasoning)
        return delta

    def finish(self) -> dict:
        """The delta of whatever was held back, at the end of the output."""
        return self._run(self._held, final=True)

    def result(self) -> ParsedMessage:
        """The whole message (after ``finish``)."""
        text = "".join(self.content)
        if self.tool_calls:
            text = text.strip()
        reasoning = "".join(self.reasoning) if self._opened else None
        content = text or (None if self.tool_calls else "")
        if self.cfg.legacy_functions and self.tool_calls:
            return ParsedMessage(reasoning, content, [], self.reasoning_tokens, dict(self.tool_calls[0]["function"]))
        return ParsedMessage(reasoning, content, self.tool_calls, self.reasoning_tokens)

    # ------------------------------------------------------------------ internals
    def _count(self, text: str, token_ids, was_reasoning: bool) -> None:
        if not self._counting or not was_reasoning:
            return
        n = len(token_ids) if token_ids is not None else 0
        if self.state in ("start", "reasoning"):
            self.reasoning_tokens += n
            return
        self._counting = False  # the block closed inside this update
        end = self.cfg.think_end_id
        if token_ids and end is not None and end in token_ids:
            self.reasoning_tokens += token_ids.index(end) + 1
        elif token_ids:  # no single </think> token: attribute by the share of the text that was reasoning
            cut = text.find(THINK_END)
            share = (cut + len(THINK_END)) / len(text) if cut >= 0 and text else 0.0
            self.reasoning_tokens += round(n * share)

    def _run(self, buf: str, final: bool) -> dict:
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[dict] = []
        while True:
            if self.state == "start":
                stripped = buf.lstrip()
                if stripped.startswith(THINK_START):
                    buf = stripped[len(THINK_START) :]
                    self.state = "reasoning"
                    self._opened = True
                    continue
                if not final and THINK_START.startswith(stripped):
                    break  # could still become <think>
                self.state = "content"
                self._counting = False
                continue
            if self.state == "reasoning":
                cut = buf.find(THINK_END)
                if cut >= 0:
                    reasoning.append(buf[:cut])
                    buf = buf[cut + len(THINK_END) :]
                    self.state = "after_think"
                    continue
                keep = 0 if final else _partial_suffix(buf, THINK_END)
                reasoning.append(buf[: len(buf) - keep])
                buf = buf[len(buf) - keep :]
                break
            if self.state == "after_think":
                stripped = buf.lstrip()
                if not stripped and not final:
                    buf = ""
                    break
                buf = stripped
                self.state = "content"
                continue
            if self.state == "content":
                if not self.cfg.tools:
                    self._content(content, buf)
                    buf = ""
                    break
                cut = buf.find(TOOL_START)
                if cut >= 0:
                    self._content(content, buf[:cut], before_call=True)
                    buf = buf[cut + len(TOOL_START) :]
                    self.state = "tool"
                    continue
                keep = 0 if final else _partial_suffix(buf, TOOL_START)
                if not final and not buf[: len(buf) - keep].strip():
                    break  # whitespace (before or between calls): held until text, a call or the end decides
                self._content(content, buf[: len(buf) - keep])
                buf = buf[len(buf) - keep :]
                break
            if self.state == "tool":
                cut = buf.find(TOOL_END)
                if cut < 0 and not final:
                    break
                body = buf if cut < 0 else buf[:cut]
                call = _tool_call(body)
                if call is not None:
                    call["index"] = len(self.tool_calls)
                    self.tool_calls.append(call)
                    calls.append(call)
                else:  # not a call after all: the model's text, tags included
                    raw = TOOL_START + body + ("" if cut < 0 else TOOL_END)
                    content.append(raw)
                    self.content.append(raw)
                buf = "" if cut < 0 else buf[cut + len(TOOL_END) :]
                self.state = "content"
                if final and not buf:
                    break
                continue
        self._held = buf
        self.reasoning.extend(r for r in reasoning if r)
        delta: dict = {}
        text = "".join(reasoning)
        if text:
            delta["reasoning"] = text
        text = "".join(content)
        if text:
            delta["content"] = text
        if calls and self.cfg.legacy_functions:
            if calls[0]["index"] == 0:  # the one call the deprecated form holds
                delta["function_call"] = dict(calls[0]["function"])
        elif calls:
            delta["tool_calls"] = calls
        return delta

    def _content(self, out: list, text: str, before_call: bool = False) -> None:
        if not text or ((before_call or self.tool_calls) and not text.strip()):
            return  # the blank lines around calls are not content
        out.append(text)
        self.content.append(text)


def with_alias(delta: dict) -> dict:
    """A delta (or message) with its reasoning also under ``reasoning_content``, the older name many clients read."""
    if "reasoning" in delta:
        delta["reasoning_content"] = delta["reasoning"]
    return delta


def finish_delta(parser: ChatOutputParser, delta: dict, finish_reason: str | None) -> tuple[dict, str | None]:
    """``delta`` completed with what the parser held back, and the finish reason a client sees: "tool_calls"
    when the model stopped after calling tools ("function_call" in the deprecated form)."""
    for key, value in parser.finish().items():
        delta[key] = delta[key] + value if key in delta else value
    if parser.tool_calls and finish_reason == "stop":
        finish_reason = "function_call" if parser.cfg.legacy_functions else "tool_calls"
    return delta, finish_reason


def _tool_call(body: str) -> dict | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # already a JSON text
        try:
            json.loads(args)
        except ValueError:
            return None
    else:
        args = json.dumps(args, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": args},
    }
