"""What steers decoding beyond the sampling parameters, from a request body to the engine's specs:
``logit_bias`` (token ids and bounds), ``response_format`` (text / json_object / json_schema → a structured-output
spec), ``tools`` and ``tool_choice`` (validated; a forced call becomes an llguidance Lark grammar over Qwen's
``<tool_call>`` format), and the think-block prefix a thinking model may write before a constrained answer.
Every problem is an ``InvalidRequestError`` naming its parameter."""

from __future__ import annotations

import json
import re

from kernellab.runtime.request.errors import InvalidRequestError


def parse_logit_bias(bias: dict, vocab: int) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        token = key.strip()
        if not (token.isascii() and token.isdigit()) or int(token) >= vocab:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids in [0, {vocab}), got {key!r}", param="logit_bias"
            )
        if not -100 <= value <= 100:  # before float(): an int beyond a float's range would overflow there
            raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias")
        out[int(token)] = float(value)
    return out


def structured_spec(response_format: dict | None) -> dict | None:
    """``response_format`` → the engine's structured-output spec (None for text)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
            raise InvalidRequestError(
                "response_format.json_schema must be an object with a name and a schema", param="response_format"
            )
        schema = spec.get("schema", {})  # OpenAI: an absent schema allows any JSON
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                "response_format.json_schema.schema must be a JSON Schema object", param="response_format"
            )
        return {"json_schema": schema or {"type": "object"}}
    raise InvalidRequestError(
        f"response_format.type must be text, json_object or json_schema, got {kind!r}", param="response_format"
    )


_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


def validate_tools(tools: list | None) -> list[dict]:
    if not tools:
        return []
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise InvalidRequestError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param=f"tools[{i}]"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise InvalidRequestError(
                f"tools[{i}].function.name must be 1-64 letters, digits, '_', '-', '.' or ':'",
                param=f"tools[{i}].function.name",
            )
        if name in names:
            raise InvalidRequestError(f"tools[{i}]: the function name {name!r} is used twice", param="tools")
        names.add(name)
        if not isinstance(fn.get("parameters", {}), dict) or not isinstance(fn.get("description", ""), str):
            raise InvalidRequestError(
                f"tools[{i}].function: parameters must be a JSON Schema object and description a string",
                param=f"tools[{i}].function",
            )
    return tools


def forced_tool_names(tools: list[dict], choice) -> list[str] | None:
    """The functions a tool_choice forces a call to (None: nothing forced)."""
    if choice is None or choice in ("auto", "none"):
        return None
    if choice == "required":
        if not tools:
            raise InvalidRequestError("tool_choice 'required' needs tools", param="tool_choice")
        return [t["function"]["name"] for t in tools]
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in {t["function"]["name"] for t in tools}:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        return [name]
    raise InvalidRequestError(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
        param="tool_choice",
    )


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a Lark string literal: JSON's escaping is valid there


def tool_call_grammar(tools: list[dict], names: list[str], parallel: bool, think: str) -> str:
    """A Lark grammar (llguidance dialect) that admits only Qwen-format calls to ``names``, each call's
    arguments valid against its function's parameters. ``think``: "" (no think block), "optional" (the model
    may think first) or "open" (the prompt opened the block; the model must close it)."""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    schemas = [
        {
            "type": "object",
            "properties": {"name": {"const": n}, "arguments": by_name[n].get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for n in names
    ]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    calls = 'call ("\\n" call)*' if parallel else "call"
    return _with_think(
        f"body: {calls}\ncall: {_lark_string('<tool_call>' + chr(10))} call_json "
        f"{_lark_string(chr(10) + '</tool_call>')}\ncall_json: %json {json.dumps(schema)}\n",
        think,
    )


def _with_think(rules: str, think: str) -> str:
    # A lazy rule ends at the first "</think>": the block closes there and the constrained body follows.
    block = 'think[lazy]: THINK_TEXT "</think>"\nTHINK_TEXT: /(.|\\n)*/\nWS: /[ \\t\\n]*/\n'
    if think == "open":
        return "start: think WS body\n" + block + rules
    if think == "optional":
        return 'start: ("<think>" think WS)? body\n' + block + rules
    return "start: body\n" + rules


def structured_with_think(spec: dict, think: str) -> dict:
    """A structured-output spec that lets a thinking model finish its think block first."""
    if not think:
        return spec
    kind, value = next(iter(spec.items()))
    if kind not in ("json_schema", "json_object"):
        return spec
    schema = value if kind == "json_schema" else {"type": "object"}
    # Compact JSON, as the engine compiles a schema without a think block (runtime/request/structured.py says why).
    body = f"body: %json {json.dumps({**schema, 'x-guidance': {'whitespace_flexible': False}})}\n"
    return {"lark": _with_think(body, think)}
