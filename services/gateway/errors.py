"""HTTP-level errors of the gateway, in the OpenAI error shape (``{"error": {message, type, param, code}}``)."""

from __future__ import annotations

from kernellab.runtime.request.errors import KernellabError


class Unauthorized(KernellabError):
    status_code = 401
    error_type = "invalid_request_error"

    def __init__(self, message: str):
        super().__init__(message, code="invalid_api_key")


class NotFound(KernellabError):
    status_code = 404
    error_type = "invalid_request_error"


class MethodNotAllowed(KernellabError):
    status_code = 405
    error_type = "invalid_request_error"


class PayloadTooLarge(KernellabError):
    status_code = 413
    error_type = "invalid_request_error"

    def __init__(self, limit: int):
        super().__init__(f"request body exceeds the limit of {limit} bytes", code="payload_too_large")


class RateLimited(KernellabError):
    status_code = 429
    error_type = "rate_limit_error"
    retry_after = 1

    def __init__(self, message: str):
        super().__init__(message, code="rate_limit_exceeded")


class ServiceUnavailable(KernellabError):
    status_code = 503
    error_type = "server_error"

    def __init__(self, message: str, code: str = "service_unavailable"):
        super().__init__(message, code=code)


class DeadlineExceeded(KernellabError):
    status_code = 504
    error_type = "server_error"

    def __init__(self, message: str = "the request's deadline passed before it finished"):
        super().__init__(message, code="deadline_exceeded")


class UpstreamError(KernellabError):
    """An ``ErrorMessage`` from a worker, with the status and type the worker chose."""

    def __init__(self, status: int, message: str, error_type: str, code: str | None, param: str | None):
        super().__init__(message, param=param, code=code)
        self.status_code = status
        self.error_type = error_type


def error_headers(exc: KernellabError) -> dict[str, str]:
    headers = {}
    if isinstance(exc, RateLimited):
        headers["Retry-After"] = str(exc.retry_after)
    if isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    return headers
