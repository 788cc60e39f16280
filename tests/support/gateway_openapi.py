"""The gateway's OpenAPI document, made complete enough to fuzz and to check responses against.

Starts from the app's own ``app.openapi()`` (every route, its path and query parameters, the batch body
model) and adds what FastAPI cannot see because the generation routes read their JSON themselves:
- the request bodies of /v1/chat/completions and /v1/completions, from the very pydantic models the
  gateway validates them with (``ChatBody``, ``CompletionBody``), and the multipart form of /v1/files;
- the responses the gateway really gives: every error as an OpenAI error object (400 for bad input, never
  FastAPI's 422), 401 without a key, 404, 405, 413, 429 and 503, 504 for generation; SSE for streams.
"""

from __future__ import annotations

import copy

from kernellab.services.config import GatewaySettings

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string", "minLength": 1},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
GENERATION = {"/v1/chat/completions": "ChatBody", "/v1/completions": "CompletionBody"}


def _error(description: str) -> dict:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }


def gateway_openapi() -> dict:
    from kernellab.services.gateway.app import create_app
    from kernellab.services.gateway.requests import ChatBody, CompletionBody

    doc = copy.deepcopy(create_app(GatewaySettings(gateway_metrics_port=0), tokenizer=object()).openapi())
    doc["openapi"] = "3.1.0"
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["ErrorResponse"] = ERROR
    for model in (ChatBody, CompletionBody):
        js = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(js.pop("$defs", {}))
        schemas[model.__name__] = js
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            if path == "/health":
                continue
            if path == "/ready":
                status = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
                body = {"description": "readiness", "content": {"application/json": {"schema": status}}}
                responses["200"] = responses["503"] = body
                continue
            # No security scheme on purpose: schemathesis would spend its cases on auth variants, which
            # test_security.py covers; 401 stays documented.
            for code, what in (
                ("400", "invalid request"),
                ("401", "missing or wrong API key"),
                ("404", "unknown model, route or object"),
                ("405", "method not allowed"),
                ("413", "body over the limit"),
                ("429", "too many requests waiting"),
                ("503", "queue or workers unavailable"),
            ):
                responses[code] = _error(what)
            if path in GENERATION:
                op["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{GENERATION[path]}"}}},
                }
                responses["200"] = {
                    "description": "a completion, or its SSE stream",
                    "content": {
                        "application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                }
                responses["504"] = _error("deadline exceeded")
            elif path == "/v1/files" and method == "post":
                form = {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {"file": {"type": "string", "format": "binary"}, "purpose": {"type": "string"}},
                }
                op["requestBody"] = {"required": True, "content": {"multipart/form-data": {"schema": form}}}
            elif path == "/v1/files/{file_id}/content":
                responses["200"] = {"description": "the file", "content": {"application/jsonl": {"schema": {}}}}
    return doc
