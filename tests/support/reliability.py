"""Constants and small helpers of the reliability tests."""

from __future__ import annotations

from kernellab.services.stress import MODEL

KEY = "sk-reliability"
OTHER = "sk-other-tenant"
__all__ = ["KEY", "MODEL", "OTHER", "auth", "is_openai_error"]


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def is_openai_error(resp, status: int | None = None) -> dict:
    """The OpenAI error object of ``resp`` (asserting its shape, and its status when given)."""
    assert status is None or resp.status_code == status, (resp.status_code, resp.text[:300])
    err = resp.json()["error"]
    assert {"message", "type", "param", "code"} <= set(err) and err["message"], err
    return err
