"""Tokenizer and chat template, without torch: the gateway and the engine share this.

The fast tokenizer is HF ``tokenizers``; chat templates are the model's own Jinja template rendered the way
transformers renders them (sandboxed, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``). We do not use
transformers' tokenizer classes here because importing transformers imports torch when it is installed, and
the gateway must stay light. For a GGUF model the tokenizer is converted once by transformers' GGUF
conversion (in whichever process first needs it) and cached as ``tokenizer.json`` + ``tokenizer_config.json``;
the stop ids come from the GGUF metadata (its ``eos_token_id`` is ``<|im_end|>`` for SmolLM2, which is where a
chat turn ends; transformers' conversion reports ``<|im_start|>`` instead).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from kernellab.runtime.request.errors import ConfigError, InvalidRequestError, ModelNotAvailableError
from kernellab.runtime.request.registry import ModelSpec, local_snapshot, resolve_model

if TYPE_CHECKING:
    from jinja2 import Template

log = logging.getLogger(__name__)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def cache_root() -> Path:
    return Path(os.environ.get("KERNELLAB_CACHE_DIR", Path.home() / ".cache" / "kernellab"))


class TextTokenizer:
    """Encode/decode and the chat template of one model."""

    def __init__(self, tokenizer, config: dict, eos_token_ids: list[int]):
        self._tok = tokenizer
        self.config = config
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.chat_template: str | None = _pick_template(config.get("chat_template"))
        self.bos_token = _token_str(config.get("bos_token"))
        self.eos_token = _token_str(config.get("eos_token"))
        self.all_special_ids = sorted(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        self._template: Template | None = None  # compiled on first use
        self.generation_config: dict = {}  # the model's generation_config.json (sampling defaults), if any

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self._tok.id_to_token(i) or "" for i in ids]

    @property
    def template_knows_tools(self) -> bool:
        return bool(self.chat_template and "tools" in self.chat_template)

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None, **kwargs
    ) -> str:
        """The chat template applied to validated messages, as text. ``tools`` (OpenAI function tools) go to a
        template that renders them; a template that does not (SmolLM2's) gets them described in a system turn
        in the same ``<tool_call>`` format the gateway parses. ``kwargs`` are the template's own switches
        (``enable_thinking``); they cannot replace the arguments above."""
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template; use /v1/completions", param="messages")
        messages = validate_messages(messages)
        if "developer" not in self.chat_template:  # OpenAI's newer name for the system role
            messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        if tools and not self.template_knows_tools:
            messages = _with_tool_system_turn(messages, tools)
            tools = None
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"} & kwargs.keys()
        if reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs cannot set {', '.join(sorted(reserved))}", param="chat_template_kwargs"
            )
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **({"tools": tools} if tools else {}),
                **kwargs,
            )
        except InvalidRequestError:
            raise
        except Exception as exc:  # the template met input it cannot render (TemplateError, TypeError, ...)
            raise InvalidRequestError(
                f"the model's chat template cannot render these messages: {type(exc).__name__}: {exc}", param="messages"
            ) from None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        # The rendered template already carries any BOS text, as transformers assumes.
        return self.encode(self.render_chat(messages, add_generation_prompt, **kwargs), add_special_tokens=False)


def validate_messages(messages) -> list[dict]:
    """Checked messages, as the template should see them: text content (``None`` only where OpenAI allows it, on
    an assistant turn, and then rendered as its refusal or ""), tool calls and tool-call ids kept."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}", param=f"messages[{i}].role"
            )
        content = message.get("content")
        if not isinstance(content, str) and content is not None:
            raise InvalidRequestError(f"messages[{i}].content must be a string", param=f"messages[{i}].content")
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            if role != "assistant":
                raise InvalidRequestError(
                    f"messages[{i}]: only assistant messages carry tool_calls", param=f"messages[{i}].tool_calls"
                )
            _validate_tool_calls(tool_calls, i)
        if content is None:
            # only an assistant turn may leave it out (the API requires no more than its role): one that called
            # tools, refused (its refusal is its text) or is otherwise empty
            if role != "assistant":
                raise InvalidRequestError(
                    f"messages[{i}].content is required (a {role} message without content)",
                    param=f"messages[{i}].content",
                )
            refusal = message.get("refusal")
            message = {**message, "content": refusal if isinstance(refusal, str) and not tool_calls else ""}
        if role == "tool" and not isinstance(message.get("tool_call_id", ""), str):
            raise InvalidRequestError(
                f"messages[{i}].tool_call_id must be a string", param=f"messages[{i}].tool_call_id"
            )
        out.append(message)
    return out


def _validate_tool_calls(tool_calls, i: int) -> None:
    param = f"messages[{i}].tool_calls"
    if not isinstance(tool_calls, list):
        raise InvalidRequestError(f"{param} must be a list", param=param)
    for j, call in enumerate(tool_calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments", ""), str | dict)
        ):
            raise InvalidRequestError(
                f"{param}[{j}] must be {{'type': 'function', 'function': {{'name': str, 'arguments': str}}}}}}",
                param=param,
            )


def _with_tool_system_turn(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Describe the tools in the system turn for a template that has no place for them."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    text = (
        "You can call functions. Their signatures are inside <tools></tools>:\n<tools>\n"
        + listing
        + "\n</tools>\nTo call one, answer with a JSON object holding the function's name and its arguments "
        'inside <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>"
    )
    if messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _token_str(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _pick_template(template) -> str | None:
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default") or next(iter(named.values()), None)
    return template


def _compile_template(source: str) -> Template:
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise InvalidRequestError(f"chat template: {message}", param="messages")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ConfigError(f"the model's chat template does not compile: {exc}") from None


def _gguf_eos_ids(path: Path) -> list[int]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        field = reader.fields.get(key)
        if field is not None:
            ids.append(int(field.parts[field.data[0]][0]))
    return ids


def _convert_gguf_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """One-time conversion through transformers (imports torch if installed), cached on disk."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tok.save_pretrained(str(tmp))
    extra = {"eos_token_ids": _gguf_eos_ids(gguf_path), "source": str(gguf_path)}
    (tmp / "kernellab.json").write_text(json.dumps(extra))
    try:
        tmp.rename(out_dir)
    except OSError:  # another process converted it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def tokenizer_dir(spec: ModelSpec) -> Path:
    """Directory with tokenizer.json + tokenizer_config.json for ``spec`` (converting a GGUF tokenizer once)."""
    snapshot = local_snapshot(spec)
    if snapshot is None:
        raise ModelNotAvailableError(
            f"model {spec.name!r} is not on this machine and the hub is not reachable: run "
            f"`kernellab download {spec.name}` on a machine with network access (or set HF_HOME to a cache holding it)"
        )
    if snapshot.is_dir():
        return snapshot
    stat = snapshot.stat()
    key = hashlib.sha256(f"{snapshot}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:16]
    out = cache_root() / "tokenizers" / f"{Path(spec.name).name}-{key}"
    if not (out / "tokenizer.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        _convert_gguf_tokenizer(snapshot, out)
    return out


def _eos_ids_from_dir(path: Path, config: dict, tok) -> list[int]:
    extra = path / "kernellab.json"
    if extra.exists():
        return json.loads(extra.read_text())["eos_token_ids"]
    ids: list[int] = []
    gen = path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    eos_token = _token_str(config.get("eos_token"))
    if eos_token and tok.token_to_id(eos_token) is not None:
        ids.append(tok.token_to_id(eos_token))
    return ids


@lru_cache(maxsize=8)
def _load_from_dir(path: str) -> TextTokenizer:
    from tokenizers import Tokenizer

    root = Path(path)
    if not (root / "tokenizer.json").exists():
        raise ModelNotAvailableError(f"{root} has no tokenizer.json (a fast tokenizer is required)")
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    config_path = root / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    template_file = root / "chat_template.jinja"
    if not config.get("chat_template") and template_file.exists():
        config["chat_template"] = template_file.read_text()
    out = TextTokenizer(tok, config, _eos_ids_from_dir(root, config, tok))
    gen = root / "generation_config.json"
    if gen.exists():
        try:
            out.generation_config = json.loads(gen.read_text())
        except ValueError:
            log.warning("%s is not valid JSON: no sampling defaults from it", gen)
    return out


def load_tokenizer(model: str | ModelSpec) -> TextTokenizer:
    spec = resolve_model(model) if isinstance(model, str) else model
    return _load_from_dir(str(tokenizer_dir(spec)))
