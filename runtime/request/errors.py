"""Typed errors shared by the engine, the CLI and the gateway (no torch).

The gateway maps each onto an OpenAI-style error object; the CLI prints its message on one line.
"""

from __future__ import annotations


class KernellabError(Exception):
    """Base class: ``message`` is meant for a user, ``status_code`` for the HTTP layer."""

    status_code = 500
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class ConfigError(KernellabError):
    """A server-side configuration mistake: an engine setting out of range, a checkpoint or chat template the
    runtime cannot use, an option the device does not support. Raised where the operator's configuration is
    checked (``EngineConfig``, ``ModelConfig``, engine start), not for anything a client sent, so should one
    ever reach an HTTP response it is the server's error (500), never a 4xx."""

    status_code = 500
    error_type = "server_error"


class InvalidRequestError(KernellabError):
    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthError(InvalidRequestError):
    def __init__(self, message: str, *, param: str | None = "messages"):
        super().__init__(message, param=param, code="context_length_exceeded")


class UnknownModelError(KernellabError):
    status_code = 404
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = "model"):
        super().__init__(message, param=param, code="model_not_found")


class ModelNotAvailableError(KernellabError):
    """The model is known but its weights are not on this machine and cannot be fetched."""

    status_code = 503
    error_type = "server_error"
